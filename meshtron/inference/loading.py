"""Build the model and tokenizer a checkpoint was trained with, for inference (optionally sharded
with the training tensor-parallel plans), and find the tokenizer's chat template."""

from __future__ import annotations

from pathlib import Path

from meshtron.data.chat import read_chat_template

__all__ = ["load_model_and_tokenizer", "load_tokenizer", "model_name_for", "read_chat_template"]


def load_model_and_tokenizer(path, device_name: str = "auto", tp_mesh=None, dtype: str = "float32",
                             tokenizer: str | None = None):
    """-> (model in eval mode with the checkpoint's weights, tokenizer, a model name). dtype: an
    engine.dtype (auto: bfloat16 on CUDA, float32 on a CPU); the engine's KV cache takes the weights' dtype.
    tokenizer: a path replacing the checkpoint's tokenizer (engine.tokenizer, `--tokenizer`)."""
    from meshtron.checkpoint import checkpoint_run_config, load_checkpoint
    from meshtron.models import GPTModel
    from meshtron.training.precision import resolve_engine_dtype
    from meshtron.training.trainer import resolve_device

    cfg = checkpoint_run_config(path, tokenizer)   # the tokenizer it carries, found from any directory
    tokenizer = _tokenizer(cfg)
    device = resolve_device(device_name)
    model = GPTModel(cfg.model, tokenizer.vocab_size).to(device)
    if tp_mesh is not None:
        from meshtron.parallel.tensor_parallel import apply_tp

        # Sequence parallelism would split the query dimension, which is 1 for a decode: off.
        apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=False)
    load_checkpoint(path, model)
    # cast after loading: checkpoints hold fp32 master weights, loaded as they are, then cast once
    model.to(resolve_engine_dtype(dtype, device))
    model.eval()
    return model, tokenizer, model_name_for(path)


def _tokenizer(cfg):
    from meshtron.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(cfg.tokenizer)
    tokenizer.chat_template = read_chat_template(cfg.tokenizer.path if cfg.tokenizer.type == "hf" else None)
    return tokenizer


def load_tokenizer(path, tokenizer: str | None = None):
    """Only the tokenizer (with its chat template) a checkpoint was trained with, or `tokenizer`: what
    the HTTP front of data-parallel replicas needs, without the weights."""
    from meshtron.checkpoint import checkpoint_run_config

    return _tokenizer(checkpoint_run_config(path, tokenizer))


def model_name_for(path) -> str:
    """The checkpoint's directory name; a run's `checkpoints` dir is named after the run."""
    p = Path(path).resolve()
    return p.parent.name if p.name == "checkpoints" else p.name
