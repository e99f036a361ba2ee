"""Run the layer on real text: tokenize, seed, build, run on the device, return a Trace."""

from __future__ import annotations

from attnctl.config import LayerConfig
from attnctl.errors import RUNTIME, AttnctlError
from attnctl.tokenize import encode
from attnctl.trace import Trace


def run_text(text: str, config: LayerConfig) -> Trace:
    """Tokenize ``text`` and run one seeded attention layer over it."""
    encoded = encode(text, config.tokenizer)
    import torch

    from attnctl.layer import TORCH_DTYPES, AttentionLayer, Recorder, resolve_device

    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    layer = AttentionLayer(config, encoded.vocab_size)  # float32 on CPU: same weights anywhere
    layer = layer.to(device=device, dtype=TORCH_DTYPES[config.dtype]).eval()
    token_ids = torch.tensor([[t.id for t in encoded.tokens]], device=device)  # (B, L)
    record = Recorder()
    try:
        with torch.inference_mode():
            result = layer(token_ids, record)
            weights = None if result.weights is None else result.weights.float().cpu().tolist()
    except torch.OutOfMemoryError as error:
        raise AttnctlError(
            f"out of memory on {device}: {_first_line(error)}", exit_code=RUNTIME
        ) from error
    except RuntimeError as error:
        message = _first_line(error)
        if "memory" in message or "allocate" in message:
            raise AttnctlError(
                f"out of memory on {device}: {message}", exit_code=RUNTIME
            ) from error
        raise AttnctlError(f"the layer failed on {device}: {message}", exit_code=RUNTIME) from error
    return Trace(
        tokens=[encoded.tokens],
        stages=record.stages,
        attention=weights,
        device=str(device),
        tokenizer=encoded.name,
        vocab_size=encoded.vocab_size,
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
