"""Local text and a small BPE tokenizer trained on it, for the prepared-data tests: no network."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the", "swarm", "trains", "a", "model", "while", "peers", "join", "and", "leave", "each", "outer", "step",
         "averages", "pseudo", "gradients", "over", "slow", "links", "int8", "codes", "shard", "manifest", "tokens",
         "resume", "kill", "digest", "eval", "window")  # fmt: skip


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + rng.choice([".", "!\n", "?"])


def write_corpus(root: Path, *, seed: int = 7, rows: int = 300) -> tuple[list[Path], list[str]]:
    """Three .txt files in a folder (one of them a document over several 1000-token shards) and a
    .jsonl of `rows` documents with blank lines between some: (the input paths, the documents in
    the order prepare reads them)."""
    rng = random.Random(seed)
    (root / "books").mkdir(parents=True)
    texts = []
    for name in ("b.txt", "a.txt", "c.txt"):  # a folder's files are read sorted: a, b, c
        body = text(rng, 2600 if name == "b.txt" else 40)
        (root / "books" / name).write_text(body)
        texts.append((name, body))
    docs = [body for _, body in sorted(texts)]
    lines = []
    for i in range(rows):
        body = text(rng, rng.randint(3, 60))
        docs.append(body)
        lines.append(json.dumps({"text": body, "id": i}))
        if i % 50 == 0:
            lines.append("   ")  # a blank line is no document
    (root / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return [root / "books", root / "rows.jsonl"], docs


def train_tokenizer(docs: list[str], path: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE with <|endoftext|> (id 0), saved as a tokenizer.json."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))
    return path


def prepared_data(root: Path, *, seed: int, rows: int, shard_tokens: int, eval_every: int, eval_tokens: int) -> Path:
    """write_corpus and train_tokenizer under `root`, prepared into `root`/data (returned)."""
    from swarm.model.prepare import PrepareConfig, load_tokenizer, prepare

    paths, docs = write_corpus(root / "text", seed=seed, rows=rows)
    tok = load_tokenizer(str(train_tokenizer(docs, root / "tok.json")))
    config = PrepareConfig(shard_tokens=shard_tokens, eval_every=eval_every, eval_tokens=eval_tokens)
    prepare(paths, tok, root / "data", config)
    return root / "data"
