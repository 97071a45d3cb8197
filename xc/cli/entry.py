"""What `xc-train` does with its command line before hydra and before any work.

* Override keys are checked against the typed config (`check_overrides`). Hydra rejects an unknown
  key itself, with "use +train.epoch=2 to append": advice that would only make xc's own check fail a
  moment later. Here a misspelled key gets xc's line with a did-you-mean, naming the dotted key.
* A value with spaces that the shell split (`data.path=/my data/x` unquoted: `data.path=/my` and `data/x`), or one
  hydra cannot lex, gets one line saying how to quote it, instead of hydra's LexerNoViableAltException.
* Paths become absolute (`absolute_paths`): config.json, checkpoints and `xc-eval` then find the data
  and the run from any working directory, and launch scripts may run from anywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path

from xc.config import XCConfig
from xc.errors import ConfigError, XCError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def config_groups(conf_dir: Path = CONF_DIR) -> set[str]:
    """Hydra config group names (`data=bibtex`, `experiment=...`): the directories under conf/."""
    return {p.name for p in conf_dir.iterdir() if p.is_dir()} if conf_dir.is_dir() else set()


def check_override_key(key: str, groups: set[str]) -> None:
    """Raise ConfigError naming `key` (dotted) when it is no field of XCConfig; groups pass."""
    if key.startswith("hydra") or "@" in key or "/" in key or (key in groups and "." not in key):
        return
    cls: type | None = XCConfig
    walked = []
    for part in key.split("."):
        if cls is None or not dataclasses.is_dataclass(cls):
            return  # inside a list or a plain value: hydra and the type check judge it
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            prefix = ".".join(walked) + "." if walked else ""
            choices = names + (sorted(groups) if not walked else [])
            close = difflib.get_close_matches(part, choices, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(prefix + part, f"unknown key{hint}")
        walked.append(part)
        tp = hints[part]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        cls = tp if dataclasses.is_dataclass(tp) else (args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0])
                                                        else None)


def _quote_hint(key: str, value: str) -> XCError:
    quote = "'" if "'" not in value else '"'
    return XCError(f"{key}={value}: quote a value with spaces: {key}={quote}{value}{quote}")


def check_quoting(argv: list[str]) -> None:
    """Raise XCError with the quoted form when a `key=value` is followed by words without '=' (a value with spaces
    the shell split: hydra takes each word for an override and fails to lex it), or when a value with spaces is one
    hydra cannot lex."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if "=" not in arg or arg.startswith("-"):
            i += 1
            continue
        j = i + 1
        while j < len(argv) and "=" not in argv[j] and not argv[j].startswith(("-", "~", "+")):
            j += 1  # a word after key=value that no flag took: the rest of a split value
        key, value = arg.split("=", 1)
        if j > i + 1:
            raise _quote_hint(key, " ".join([value] + argv[i + 1 : j]))
        if any(c.isspace() for c in value):
            from hydra.core.override_parser.overrides_parser import OverridesParser

            try:
                OverridesParser.create().parse_overrides([arg])
            except Exception:  # hydra's OverrideParseException (its lexer's error inside)
                raise _quote_hint(key, value) from None
        i = j


def check_overrides(argv: list[str], groups: set[str] | None = None) -> None:
    """Check every plain `key=value` override in `argv` (hydra's flags, `+key` appends and `~key`
    deletions are left to hydra), and the quoting of values with spaces (`check_quoting`)."""
    groups = config_groups() if groups is None else groups
    check_quoting(argv)
    for arg in argv:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        check_override_key(arg.split("=", 1)[0].strip(), groups)


def _absolute(path: str | None) -> str | None:
    return None if path in (None, "") else os.path.abspath(os.path.expanduser(path))


def absolute_paths(cfg: XCConfig) -> XCConfig:
    """The config with every path resolved against the current directory (a new frozen config)."""
    replace = dataclasses.replace
    return replace(cfg, run_dir=_absolute(cfg.run_dir),
                   data=replace(cfg.data, path=_absolute(cfg.data.path), cache_dir=_absolute(cfg.data.cache_dir)),
                   model=replace(cfg.model, path=_absolute(cfg.model.path)),
                   sampler=replace(cfg.sampler, tree=replace(cfg.sampler.tree,
                                                             cache_path=_absolute(cfg.sampler.tree.cache_path))))


def check_eval_args(args) -> None:
    """`xc-eval`'s arguments, checked before a checkpoint is read: one line naming the flag or path."""
    if args.topk is not None and args.topk < 1:
        raise XCError(f"--topk must be >= 1, got {args.topk}")
    if args.max_points is not None and args.max_points < 0:
        raise XCError(f"--max-points must be >= 0 (0 = all test points), got {args.max_points}")
    if not Path(args.run_dir).is_dir() and not args.checkpoint:
        raise XCError(f"run directory {args.run_dir} does not exist")
    for flag, target in (("--predictions", args.predictions), ("--out", args.out)):
        if target and not Path(target).resolve().parent.is_dir():
            raise XCError(f"{flag} {target}: directory {Path(target).resolve().parent} does not exist")


def data_name(kind: str, path: str | None) -> str:
    """`data.name` of the bare data group: "synthetic" for generated data, else the name of the data's
    directory (so `xc-train data.kind=xc_sparse data.path=/data/Eurlex` runs in runs/Eurlex-astra, not
    in the synthetic run's directory)."""
    if kind in ("synthetic", "synthetic_lf") or not path:
        return "synthetic" if kind != "synthetic_lf" else "synthetic_lf"
    return Path(str(path).rstrip("/\\")).name or "data"


def register_resolvers() -> None:
    """OmegaConf resolvers the config files use (`${xc_data_name:...}`); safe to call more than once."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("xc_data_name"):
        OmegaConf.register_new_resolver("xc_data_name", data_name)


def command_main(parser, check, run, argv: list[str] | None = None) -> int:
    """An argparse command's main: parse, `check(args)`, `run(args)`; an XCError ends with one line `error: ...`
    and exit code 2, a reader of stdout that left (`... | head`) with 0."""
    import logging
    import sys

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        check(args)
        run(args)
    except XCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return 0
