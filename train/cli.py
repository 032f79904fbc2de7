"""Command lines of the experiments: `--set key=value` overrides of any (nested) config field,
checked against the field's type, and a parser that refuses unknown or invalid options.

    config = apply_overrides(config, ["optim.learning_rate=1e-3", "model.moe.top_k=4",
                                      "data.paths=a.txt,b.jsonl", "optim.clip_norm=none"])

Values are read by the field's annotation: int, float, bool (true/false/1/0/yes/no), str, a
Literal's choices, `X | None` ("none"), `tuple[X, ...]` (comma-separated, "" for empty). The config
classes' own checks (`__post_init__`) then validate the result.

An experiment's main parses its command line (`make_parser`, then `resolve_config` for --set),
takes `out = run_folder(args, config, DEFAULT_OUT)` (--print-config prints and exits there) and
runs its job inside `one_line_errors(args.debug)`: the project's refusals (a ValueError or
OSError: a bad setting, a run folder that cannot be written, changed data, a damaged checkpoint)
end the process with one line, `error: ...`, on stderr and exit status 2; `--debug` shows the
traceback instead.
"""

import argparse
import contextlib
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from train.distributed import initialize

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


def _parse_scalar(text: str, kind: type) -> Any:
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"expected a boolean (true or false), got {text!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if kind is str:
        return text
    raise ValueError(f"fields of type {kind} cannot be set from the command line")


def parse_value(text: str, annotation: Any) -> Any:
    """`text` read as a value of type `annotation` (see the module docstring).

    Raises ValueError saying what was expected.
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        for choice in args:
            try:
                value = _parse_scalar(text, type(choice))
            except ValueError:
                continue
            if value == choice:
                return choice
        raise ValueError(f"expected one of {list(args)}, got {text!r}")
    if origin in (typing.Union, types.UnionType):
        # A choice of an optional Literal wins over None: "none" of `Literal["none", ...] | None`
        # is the choice, not "unset".
        if any(typing.get_origin(a) is Literal and text in typing.get_args(a) for a in args):
            return text
        if type(None) in args and text.lower() in _NONE:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return parse_value(text, option)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(" or ".join(errors) + (" or none" if type(None) in args else ""))
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise ValueError(f"fields of type {annotation} cannot be set from the command line")
        items = [item.strip() for item in text.split(",")] if text.strip() else []
        return tuple(parse_value(item, args[0]) for item in items)
    if dataclasses.is_dataclass(annotation):
        raise ValueError(
            f"this is a group of settings ({annotation.__name__}); set one of its fields: "
            f"{', '.join(f.name for f in dataclasses.fields(annotation))}"
        )
    return _parse_scalar(text, annotation)


def _split_assignment(assignment: str) -> tuple[list[str], str]:
    key, sep, text = assignment.partition("=")
    names = key.strip().split(".")
    if not sep or not all(names):
        raise ValueError(
            f"{assignment!r} is not of the form key=value (e.g. optim.learning_rate=1e-3)"
        )
    return names, text


def apply_overrides(config, assignments: Sequence[str]):
    """A copy of the (frozen, nested) dataclass `config` with `dotted.key=value` assignments.

    All assignments to one config object are applied together (so that fields which must agree,
    like model.num_layers and model.kda_layers, can change at once); a later assignment of the
    same key wins. Raises ValueError naming the key, for a missing '=', an unknown key, a value
    of the wrong type, or values the config class rejects.
    """
    tree: dict = {}
    for assignment in assignments:
        names, text = _split_assignment(assignment)
        node = tree
        for depth, name in enumerate(names[:-1]):
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ValueError(
                    f"{'.'.join(names[: depth + 1])} is set as a value and also has fields set"
                )
        if isinstance(node.get(names[-1]), dict):
            raise ValueError(f"{'.'.join(names)} is a group of settings; set one of its fields")
        node[names[-1]] = (text, ".".join(names))
    return _apply(config, tree, "")


def _apply(config, tree: dict, prefix: str):
    if not dataclasses.is_dataclass(config):
        raise ValueError(f"unknown setting {prefix[:-1]!r}.*: it has no fields to set")
    names = [f.name for f in dataclasses.fields(config)]
    types_ = typing.get_type_hints(type(config))
    changes = {}
    for name, node in tree.items():
        if name not in names:
            raise ValueError(
                f"unknown setting {prefix + name!r}: {type(config).__name__} has no field "
                f"{name!r}; its fields are {', '.join(names)}"
            )
        if isinstance(node, dict):
            changes[name] = _apply(getattr(config, name), node, f"{prefix}{name}.")
            continue
        text, key = node
        try:
            changes[name] = parse_value(text, types_[name])
        except ValueError as error:
            raise ValueError(f"{key}={text!r}: {error}") from None
    try:
        return dataclasses.replace(config, **changes)
    except (ValueError, TypeError) as error:
        keys = ", ".join(f"{prefix}{name}" for name in changes)
        raise ValueError(f"{keys}: {error}") from None


def config_dict(config) -> dict:
    """The nested dataclass `config` as plain JSON-able data (tuples become lists)."""
    return dataclasses.asdict(config)


def _tuples(value):
    """JSON lists back to the tuples the configs hold (nested ones too)."""
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def config_from_dict(cls, data: dict):
    """The frozen dataclass `cls` from its `config_dict` form (as read back from JSON): the
    inverse of `config_dict`. Fields missing from `data` keep their defaults; an unknown key
    raises a ValueError naming it, and the config class checks the values as usual."""
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; its fields are "
                         f"{', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        kinds = typing.get_args(hints[name]) or (hints[name],)
        nested = [kind for kind in kinds if dataclasses.is_dataclass(kind)]
        if isinstance(value, dict) and nested:
            value = config_from_dict(nested[0], value)
        values[name] = _tuples(value)
    return cls(**values)


def make_parser(prog: str, description: str, *,
                multi_process: bool = False) -> argparse.ArgumentParser:
    """The shared options: --set (repeatable), --out, --resume, --allow-data-change,
    --print-config, --debug; with `multi_process`, those of a multi-process run, which the
    experiment passes to `join_processes` before it touches a device. Unknown options are
    refused."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config field, e.g. --set optim.learning_rate=1e-3 --set "
        "model.moe.top_k=4 --set data.seq_len=512 (repeatable; --print-config lists the fields)",
    )
    parser.add_argument("--out", metavar="DIR", help="run folder (metrics, checkpoints, plots)")
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last checkpoint"
    )
    parser.add_argument(
        "--allow-data-change", action="store_true",
        help="with --resume: continue even though the data files changed since the run started "
        "(the old data manifest is kept in data_manifest.json's history)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--debug", action="store_true",
        help="on an error, show the full traceback instead of one line",
    )
    if not multi_process:
        return parser
    processes = parser.add_argument_group(
        "multi-process runs (jax.distributed; see docs/multi_host.md)")
    processes.add_argument(
        "--coordinator-address", metavar="HOST:PORT",
        help="process 0's host and a free port, the same in every process (default: "
        "$JAX_COORDINATOR_ADDRESS)")
    processes.add_argument("--num-processes", type=int, metavar="N",
                           help="processes in the run (default: $JAX_NUM_PROCESSES, else one)")
    processes.add_argument("--process-id", type=int, metavar="I",
                           help="this process's rank in [0, N) (default: $JAX_PROCESS_ID)")
    processes.add_argument(
        "--distributed-auto", action="store_true",
        help="let JAX detect the three on SLURM, Open MPI, Kubernetes or Cloud TPU")
    return parser


def join_processes(args: argparse.Namespace) -> bool:
    """Joins the multi-process run that `make_parser`'s options (or the environment) describe,
    before anything touches a device (`train.distributed.initialize`); returns whether there are
    several processes. Raises ValueError naming a missing or invalid option."""
    return initialize(args.coordinator_address, args.num_processes, args.process_id,
                      auto=args.distributed_auto)


def error_line(error: BaseException) -> str:
    """`error`'s message on one line (its lines joined by '; ')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


class RunStopped(RuntimeError):
    """A run that stopped for a reason its message names, with what to do (`train.loop`)."""


@contextlib.contextmanager
def one_line_errors(debug: bool = False):
    """Ends the process with `error: <message>` on stderr and exit status 2 when the block raises
    a ValueError, an OSError or a `RunStopped` (the project's refusals name what to fix); with
    `debug`, lets the exception through with its traceback."""
    try:
        yield
    except (ValueError, OSError, RunStopped) as error:
        if debug:
            raise
        print(f"error: {error_line(error)}", file=sys.stderr)
        raise SystemExit(2) from None


def resolve_config(parser: argparse.ArgumentParser, args: argparse.Namespace, config):
    """`config` with the parsed --set overrides; a bad override exits through `parser.error`."""
    try:
        return apply_overrides(config, args.set)
    except ValueError as error:
        parser.error(f"--set {error}")


def run_folder(args: argparse.Namespace, config, default_out: str) -> str:
    """The run folder of an experiment: --out, else `default_out`. With --print-config, prints
    the resolved `config` as JSON and exits with status 0 instead (as --help does)."""
    if args.print_config:
        print(json.dumps(config_dict(config), indent=2))
        raise SystemExit(0)
    return args.out or default_out
