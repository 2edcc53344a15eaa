"""`zerotrain sample`: continue a prompt with the GPT stored in a checkpoint."""

from __future__ import annotations

from zerotrain.cli.args import Parser, UsageError, command, finite_float


def _parser() -> Parser:
    p = Parser("sample", "Generate text from a checkpoint of the reference GPT (any stage "
               "or world size: the shards are consolidated first).")
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
    if a.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = no limit), got {a.top_k}")
    return a.checkpoint or a.checkpoint_flag, a


@command("sample")
def main_sample(argv: list[str]) -> int:
    path, a = _checked(argv)
    import torch

    from zerotrain.checkpoint import full_state_dict
    from zerotrain.config import build_config
    from zerotrain.data.corpus import decode, encode
    from zerotrain.models.gpt import GPT

    ckpt = path
    sd, meta = full_state_dict(ckpt)
    model = GPT(build_config(meta["config"]).model)
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:  # e.g. a checkpoint of a user's own model (library mode)
        first = str(e).strip().splitlines()[0]
        raise UsageError(f"'{ckpt}' does not hold the reference GPT its config describes "
                         f"({first}); sample runs zerotrain's own GPT only") from None
    model.eval()
    idx = torch.from_numpy(encode(a.prompt).astype("int64"))[None]
    g = torch.Generator().manual_seed(a.seed)
    out = model.generate(idx, a.tokens, temperature=a.temperature, top_k=a.top_k, generator=g)
    print(decode(out[0].tolist()))
    return 0
