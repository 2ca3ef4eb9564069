"""vLLM's spellings of CLI values and files: human-readable sizes and ``--config config.yaml``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

# lower case: powers of 1000; upper case: powers of 1024 (vLLM's reading of "2k" / "2K")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*$")


def human_readable_int(text: str) -> int:
    """'2048', '2k' (2000), '2K' (2048), '25.6k' (25600); a fraction only with a decimal multiplier, and the
    result must be whole."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a number or a size such as 2k (2000) or 2K (2048)")
    number, unit = match.groups()
    if not unit:
        if "." in number:
            raise ValueError(f"{text!r} is not a whole number")
        return int(number)
    if unit in _BINARY:
        if "." in number:
            raise ValueError(f"{text!r}: a fraction needs a decimal multiplier (k, m, g, t), not {unit}")
        return int(number) * _BINARY[unit]
    # exact decimal arithmetic: 25.6k must be 25600, never 25599.999...
    whole, _, frac = number.partition(".")
    scale = _DECIMAL[unit]
    value = int(whole) * scale
    if frac:
        digits = 10 ** len(frac)
        if (int(frac) * scale) % digits:
            raise ValueError(f"{text!r} is not a whole number")
        value += int(frac) * scale // digits
    return value


def parse_size(value: Any) -> int:
    """The CLI's parser of a size option: an int (from --config) as it is, text through ``human_readable_int``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return human_readable_int(str(value))


def load_config_file(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """``--config FILE`` (vLLM's): a YAML mapping of option names (``max-model-len`` or ``max_model_len``) to
    values, used for every option the command line does not give, as vLLM reads it. An unknown name is an error."""
    if value is None:
        return None
    import yaml

    try:
        data = yaml.safe_load(Path(value).expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {value!r}: {exc}", param=param) from exc
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{value!r} is not valid YAML: {exc}", param=param) from exc
    if data is None:
        return value
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{value!r} must hold a mapping of option names to values, not "
                                 f"{type(data).__name__}", param=param)
    # the option names a config key may take: the parameter's name, or any of its flags without dashes
    params = {p.name: p for p in ctx.command.params if p.name is not None and p.name != param.name}
    # vLLM's `model:` is the positional MODEL: names first, then flags (``--model`` is a second spelling of it)
    by_key: dict[str, str] = {name: name for name in params}
    for name, p in params.items():
        for flag in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]:
            if flag.startswith("--") and not flag.startswith("--no-"):
                by_key.setdefault(flag[2:].replace("-", "_"), name)
    defaults: dict[str, Any] = {}
    unknown: list[str] = []
    for key, item in data.items():
        name = by_key.get(str(key).replace("-", "_"))
        if name is None:
            unknown.append(str(key))
            continue
        # a repeatable option given once in the file
        defaults[name] = [item] if getattr(params[name], "multiple", False) and not isinstance(item, list) else item
    if unknown:
        raise typer.BadParameter(f"{value!r} names no option of this command: {', '.join(unknown)}", param=param)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value
