"""`zerotrain config show`: the config a run would use, fully resolved."""

from __future__ import annotations

import json

from zerotrain.cli.args import Parser, command


def _parser() -> Parser:
    p = Parser("config", "Work with zerotrain configs.")
    sub = p.actions()
    show = p.action(
        sub, "show",
        "print the config a run would use: defaults, then --config FILE, then overrides",
        "Print the config a run would use: the defaults, then a --config file, "
        "then --section.key VALUE overrides (the same flags `zerotrain train` takes).",
        "zerotrain config show [--config FILE] [--json] [--section.key VALUE ...]")
    show.add_argument("--config", metavar="FILE", help="YAML or JSON config to start from")
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    ds = p.action(
        sub, "from-deepspeed", "print the zerotrain config a DeepSpeed JSON config maps to",
        "Read a DeepSpeed JSON config and print the zerotrain YAML it maps to, "
        "with a comment for every DeepSpeed-only setting; settings zerotrain cannot honour "
        "are listed together in one error. See docs/from-deepspeed.md.",
        "zerotrain config from-deepspeed DS.json [--world-size N] [--section.key VALUE ...]")
    ds.add_argument("path", metavar="DS.json", help="the DeepSpeed config file")
    ds.add_argument("--world-size", type=int, default=None,
                    help="data-parallel ranks, to derive the batch triple "
                    "(default: $WORLD_SIZE, else 1)")
    return p


@command("config")
def main_config(argv: list[str]) -> int:
    from zerotrain.config import load_config

    args, overrides = _parser().parse_known_args(argv)
    if args.action == "from-deepspeed":
        from zerotrain.deepspeed_config import deepspeed_to_yaml

        print(deepspeed_to_yaml(args.path, args.world_size, overrides or None).rstrip())
        return 0
    cfg = load_config(args.config, overrides)
    from zerotrain.models.presets import planned_model_config

    # the model as the run builds it: a preset's or model.hf's sizes, the tokenizer's vocab
    cfg = cfg.model_copy(update={"model": planned_model_config(cfg.model, cfg.data.tokenizer)})
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))
    else:
        import yaml

        if cfg.data.tokenizer.startswith("bpe:"):
            print(f"# model.vocab_size: at most {cfg.data.tokenizer[4:]}; a corpus with fewer "
                  "recurring pairs gives a smaller bpe tokenizer, and the model follows it")
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    return 0
