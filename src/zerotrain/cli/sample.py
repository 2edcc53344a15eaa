"""`zerotrain sample`: continue a prompt with the model stored in a checkpoint (any
family: the reference GPT, llama, or a Hugging Face model), through its tokenizer."""

from __future__ import annotations

from zerotrain.cli.args import Parser, UsageError, command, finite_float


def _parser() -> Parser:
    p = Parser("sample", "Generate text from a training checkpoint (any model family, stage "
               "or world size: the shards are consolidated first), encoding the prompt and "
               "decoding the output with the run's tokenizer.")
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint root (follows 'latest'), one step_* folder, or the run "
                   "folder holding checkpoints/")
    p.add_argument("--checkpoint", dest="checkpoint_flag", metavar="CHECKPOINT",
                   help="the same, as a flag (older spelling)")
    p.add_argument("--prompt", metavar="TEXT", default="def ",
                   help="text to continue, at least one byte (default: %(default)r)")
    p.add_argument("--tokens", metavar="N", type=int, default=300, help="tokens to generate (>= 0)")
    p.add_argument("--temperature", metavar="T", type=finite_float, default=0.8,
                   help="softmax temperature (>= 0; 0 picks the likeliest token)")
    p.add_argument("--top-k", metavar="K", type=int, default=50,
                   help="sample among the k likeliest tokens (0 = all)")
    p.add_argument("--seed", metavar="N", type=int, default=0, help="random seed of the sampler")
    return p


def _checked(argv: list[str]) -> tuple[str, object]:
    a = _parser().parse_args(argv)
    if (a.checkpoint is None) == (a.checkpoint_flag is None):
        raise UsageError("give the checkpoint once: zerotrain sample CHECKPOINT [options]")
    if a.prompt == "":
        raise UsageError("--prompt is empty; the model needs at least one token to continue")
    if a.tokens < 0:
        raise UsageError(f"--tokens must be >= 0, got {a.tokens}")
    if a.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {a.temperature:g}")
    if not 0 <= a.seed < 2**63:  # torch's generator takes a non-negative 64-bit seed
        raise UsageError(f"--seed must be in 0..2^63-1, got {a.seed}")
    if a.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = no limit), got {a.top_k}")
    return a.checkpoint or a.checkpoint_flag, a


@command("sample")
def main_sample(argv: list[str]) -> int:
    path, a = _checked(argv)
    import torch

    from zerotrain.checkpoint import full_state_dict
    from zerotrain.config import ModelConfig
    from zerotrain.data.tokenizer import load_tokenizer
    from zerotrain.models import build_model
    from zerotrain.models.sampling import generate

    sd, meta = full_state_dict(path)
    extra = meta.get("extra", {})
    cfg = ModelConfig.model_validate(meta["config"]["model"])
    model = build_model(cfg, hf_config=extra.get("hf_config"))
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:  # e.g. a checkpoint of a user's own model (library mode)
        first = str(e).strip().splitlines()[0]
        raise UsageError(f"'{path}' does not hold the model its config describes ({first}); "
                         "sample runs the models zerotrain builds (model.arch / model.hf)"
                         ) from None
    tok = load_tokenizer(extra.get("tokenizer", {}).get("spec", "bytes"))
    model.eval()
    ids = tok.encode(a.prompt)
    if not ids:
        raise UsageError(f"--prompt {a.prompt!r} encodes to no tokens")
    g = torch.Generator().manual_seed(a.seed)
    out = generate(model, torch.tensor([ids]), a.tokens, cfg.block_size, a.temperature,
                   a.top_k, generator=g, vocab_limit=tok.vocab_size)
    print(tok.decode(out[0].tolist()))
    return 0
