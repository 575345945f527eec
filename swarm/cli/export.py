"""swarm-export: a run's checkpoint as a Hugging Face model folder (swarm/model/export.py).

    swarm-export --checkpoint-dir ckpt --out my-model [--dtype bfloat16] [--eos-id 0] [--tokenizer tok.json] [--force]
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('my-model')"

Exit status: 0 when the folder is written; 2 for a bad command line or input (no checkpoint, a
damaged or unmappable one, an output folder that is not empty without --force), with one line
on stderr.
"""

from __future__ import annotations

from pathlib import Path

import click

from swarm.cli.common import CliError, OneLineCommand


class InputError(CliError):
    """A checkpoint or output folder that cannot be used: as a bad argument, exit 2."""

    exit_code = 2


@click.command(cls=OneLineCommand, name="swarm-export", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint-dir", required=True, type=click.Path(path_type=Path),
              help="A node's --checkpoint-dir: its newest whole checkpoint is exported.")  # fmt: skip
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The model folder to write.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="The exported weights' type (the state is float32).")  # fmt: skip
@click.option("--bos-id", type=click.IntRange(0), default=None, help="The data's begin-of-text token id, if any.")
@click.option(
    "--eos-id",
    type=click.IntRange(0),
    default=None,
    help="The data's end-of-text token id (a prepared dataset's manifest has it): generate() stops there.",
)
@click.option(
    "--tokenizer",
    default=None,
    help="The run's tokenizer (the tokenizer.json or name swarm-data prepare was given), for AutoTokenizer.",
)
@click.option("--force", is_flag=True, help="Write into an --out folder that is not empty.")
def main(checkpoint_dir: Path, out: Path, dtype: str, bos_id: int | None, eos_id: int | None, tokenizer: str | None,
         force: bool) -> None:  # fmt: skip
    """Write the newest checkpoint's θ_outer as a transformers LlamaForCausalLM folder."""
    from swarm.model.export import ExportError, ExportOptions, export_checkpoint  # torch: after parsing

    try:
        options = ExportOptions(dtype=dtype, force=force, bos_token_id=bos_id, eos_token_id=eos_id, tokenizer=tokenizer)
        result = export_checkpoint(checkpoint_dir, out, options)
    except ExportError as e:
        raise InputError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot write {out}: {e.strerror or e}") from None
    click.echo(f"wrote {result.out}: model {result.model!r} of run {result.run_id!r} at outer step {result.step}, "
               f"{result.parameters:,} parameters, {result.nbytes / 1e6:.1f} MB ({dtype})")  # fmt: skip
