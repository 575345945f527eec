"""The model, its data and DiLoCo, with no networking (DESIGN.md "Training"):

    llama.py    ModelConfig, Llama, build_model (weights a pure function of the seed), count_parameters
    presets.py  PRESETS / preset(): debug, tiny, small, 150m, 1b
    data.py     stdlib_corpus / prepared_corpus / load_data (hf: through hf_source.py) -> TokenData; node_generator,
                sample_batch, eval_windows
    loss.py     lm_loss, eval_loss, autocast_for
    diloco.py   DiLoCoConfig, DiLoCo (inner AdamW; pseudo_gradients / apply_outer)
    outer_sgd.py  the outer step's arithmetic: Nesterov SGD in single IEEE-754 operations, tensors checked
    state_hash.py  state_sha256, tensors_sha256: equal on two nodes iff the state is bit-identical
    checkpoint.py  the state's format: JSON manifest + safetensors shards (Snapshot, make_snapshot)
    checkpoint_dir.py  CheckpointDir: local checkpoints, written atomically, verified on load
    fragments.py  fragments_of: the parameters cut for Streaming DiLoCo (DiLoCoConfig.fragments)
    export.py   export_checkpoint: a checkpoint's θ_outer as a Hugging Face LlamaForCausalLM folder
    tokens.py   a prepared dataset on disk: token shards + manifest.json (read_manifest, verify, open_split)
    prepare.py  prepare: local .txt/.jsonl/.parquet files (sources.py) -> token shards, resumable

The averaging is handed in by the caller: nothing here imports swarm.averaging.
"""
