"""Recipes: TOML files with `extends`, `--set` overrides, typed frozen dataclasses, and printing.

A recipe is a TOML file with one table per section (`sections.py`), and arrays of tables where a
section lists several alike (`[[data.sources]]`). `extends = "base.toml"` (relative to the file) merges
the base first, so ablation variants only state what differs (an array of tables is replaced whole). `--set a.b=c`
overrides any key, nested ones too (`--set model.moe.topk=6`), with type checking. Every problem is
collected and reported at once, each naming its field, its value and the rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from moe_lc.config.rules import ConfigError, recipe_warnings, validate
from moe_lc.config.sections import SECTIONS, Config, ModelConfig

# [model] keys that moved into sub-tables: old flat name -> new dotted name under model.
MOVED_MODEL_KEYS = {
    **{f"rope_{k}": f"rope.{k}" for k in ("theta", "scaling", "factor", "original_seq_len", "beta_fast", "beta_slow",
                                          "mscale")},
    **{k: f"mla.{k}" for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    "mtp_depth": "mtp.depth", "mtp_loss_weight": "mtp.loss_weight", "moe_ffn_dim": "moe.ffn_dim",
    **{k: f"moe.{k}" for k in ("n_dense_layers", "n_routed_experts", "n_shared_experts", "topk", "n_groups",
                               "topk_groups", "score_func", "routed_scaling_factor", "bias_update_speed",
                               "aux_loss_weight")},
}
# keys a recipe may no longer set: dotted name -> what to write instead. parallel.microbatches could only
# restate (or contradict) the count the batch keys give, the one count the loader, the pipeline schedule
# and the balance loss's share all use.
REMOVED_KEYS = {
    "parallel.microbatches": "the micro-batches per step are train.global_batch / (train.micro_batch * dp), "
                             "derived; set train.micro_batch or train.global_batch instead",
}
INT_LIMIT = 2**62  # sizes and counts beyond this are typos; refusing them beats hanging in an allocation


def model_config(**keys) -> ModelConfig:
    """A ModelConfig from keyword arguments in the flat spelling (`topk=2, rope_factor=4.0`, the names of
    MOVED_MODEL_KEYS) or the nested one (`moe=MoEConfig(...)`): a shorthand for code and tests."""
    table: dict = {}
    for key, value in keys.items():
        sub, _, leaf = MOVED_MODEL_KEYS.get(key, key).rpartition(".")
        (table.setdefault(sub, {}) if sub else table)[leaf] = value
    nested = {k: v for k, v in table.items() if isinstance(v, dict)}
    return ModelConfig(**{k: v for k, v in table.items() if k not in nested},
                       **{k: dataclasses.replace(getattr(ModelConfig(), k), **v) for k, v in nested.items()})


# ------------------------------------------------------------------------------------------ reading


def read_recipe(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict:
    """The recipe's raw tables with `extends` chains merged (base first, then this file)."""
    path = Path(path)
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve()))
        raise ConfigError([f"extends cycle: {chain}"])
    if path.is_dir():
        raise ConfigError([f"recipe {path} is a directory, not a TOML file"])
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError([f"recipe file not found: {path}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text (byte {exc.start}): a recipe is a TOML file"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: malformed TOML: {exc}"]) from None
    base = raw.pop("extends", None)
    stray = [f"{path}: `{key} = {_toml_value(value)}` sits before any [section] header{_section_hint(key)}"
             for key, value in raw.items() if key not in SECTIONS and not isinstance(value, dict)]
    if stray:
        raise ConfigError(stray)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError([f"{path}: extends={base!r} must be a path string"])
    merged = read_recipe(path.parent / base, (*_seen, path.resolve()))
    return _deep_merge(merged, raw)


def _section_hint(key: str) -> str:
    """Where a key written above every header belongs: the one section with a field of that name (or
    of the nearest name), or the sections that share it."""
    owners: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for name, where in _field_owners(cls, section):
            owners.setdefault(name, []).append(where)
    if len(owners.get(key, ())) > 1:
        return f" (a key of {' and '.join(f'[{o}]' for o in owners[key])}: put it under one of them)"
    close = key if key in owners else next(iter(difflib.get_close_matches(key, list(owners), n=1, cutoff=0.6)), "")
    return f" (did you mean [{owners[close][0]}] {close}?)" if close and len(owners[close]) == 1 else ""


def _field_owners(cls, path: str):
    """(field name, dotted section) of every leaf field of section class `cls`, sub-tables included."""
    hints = get_type_hints(cls)
    for fl in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[fl.name]):
            yield from _field_owners(hints[fl.name], f"{path}.{fl.name}")
        else:
            yield fl.name, path


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(raw: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    """Apply `section.key=value` (or `section.sub.key=value`) strings; values parse as TOML (bare
    words count as strings)."""
    raw = _deep_merge({}, raw)
    errors = []
    for item in overrides:
        key, sep, text = item.partition("=")
        path = [part.strip() for part in key.split(".")]
        if not sep or len(path) < 2 or not all(path):
            errors.append(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. train.lr=1e-3")
            continue
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()  # a bare word such as `bf16` or `runs/x`
        table = raw
        for i, part in enumerate(path[:-1]):
            table.setdefault(part, {})
            if not isinstance(table[part], dict):
                errors.append(f"--set {item!r}: {'.'.join(path[:i + 1])!r} is not a section")
                break
            table = table[part]
        else:
            table[path[-1]] = value
    return raw, errors


# ------------------------------------------------------------------------------------------ building


def _build(cls, table: dict, path: str, errors: list[str]):
    """cls(**typed values of table); unknown keys, wrong types and sub-tables reported into errors."""
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in table.items():
        where = f"{path}.{key}"
        if key not in hints:
            if where in REMOVED_KEYS:
                errors.append(f"{where} was removed: {REMOVED_KEYS[where]}")
            elif path == "model" and key in MOVED_MODEL_KEYS:
                new = MOVED_MODEL_KEYS[key]
                sub, _, leaf = new.partition(".")
                errors.append(f"{where} moved to model.{new}: write it as `{leaf} = ...` under [model.{sub}] "
                              f"(or --set model.{new}=...)")
            else:
                options = {**{k: k for k in hints}, **(MOVED_MODEL_KEYS if path == "model" else {})}
                errors.append(f"unknown key {where}{_did_you_mean(key, options)}")
            continue
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            if isinstance(value, dict):
                kwargs[key] = _build(typ, value, where, errors)
            else:
                errors.append(f"[{where}] must be a table, got {type(value).__name__}")
            continue
        item = get_args(typ)[0] if get_origin(typ) is list else None
        if dataclasses.is_dataclass(item):  # an array of tables: [[data.sources]]
            if isinstance(value, list) and all(isinstance(v, dict) for v in value):
                kwargs[key] = [_build(item, v, f"{where}[{k}]", errors) for k, v in enumerate(value)]
            else:
                errors.append(f"{where} must be an array of tables ([[{where}]] ...), got {type(value).__name__}")
            continue
        if get_origin(typ) is list and isinstance(value, str):  # --set data.synthetic_tasks=passkey,multikey_needle
            value = [v.strip() for v in value.split(",") if v.strip()]
        problem = _check(value, typ)
        if problem is None:
            kwargs[key] = float(value) if typ is float else value
        else:
            errors.append(f"{where}={value!r} {problem}")
    return cls(**kwargs)


def build_config(raw: dict) -> Config:
    """Typed, frozen Config from raw tables; unknown sections/keys and wrong types are errors."""
    errors, sections = [], {}
    for section, table in raw.items():
        if section not in SECTIONS:
            errors.append(f"unknown section [{section}]{_did_you_mean(section, list(SECTIONS))}")
        elif not isinstance(table, dict):
            errors.append(f"[{section}] must be a table, got {type(table).__name__}")
    for section, cls in SECTIONS.items():
        table = raw.get(section, {})
        if isinstance(table, dict):
            sections[section] = _build(cls, table, section, errors)
    if errors:
        raise ConfigError(errors)
    return Config(**sections)


def load_config(path: str | os.PathLike, overrides: list[str] = (), world_size: int | None = None,
                check: bool = True, warnings: list[str] | None = None) -> Config:
    """Recipe file + overrides -> validated Config (ConfigError lists every problem). `warnings`, when
    given, receives the legal but likely mistaken settings (`recipe_warnings`), one line each."""
    recipe = read_recipe(path)
    raw, errors = apply_overrides(recipe, list(overrides))
    if errors:
        raise ConfigError(errors)
    cfg = build_config(raw)
    cfg = validate(cfg, world_size) if check else cfg
    if warnings is not None:
        warnings += [f"recipe {path} sets no keys: every field takes its default"] if not given_keys(recipe) else []
        warnings += recipe_warnings(cfg, given_keys(raw))
    return cfg


def given_keys(raw: dict, prefix: str = "") -> set[str]:
    """The dotted names of the keys raw tables set (`data.synthetic_tasks`), sub-tables' keys included."""
    keys = set()
    for key, value in raw.items():
        keys |= given_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


def _check(value, typ) -> str | None:
    """Why `value` does not fit the field type `typ` (None when it does)."""
    if typ is bool:
        return None if isinstance(value, bool) else f"must be true/false, got {type(value).__name__}"
    if typ is int:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be an integer, got {type(value).__name__}"
        return None if abs(value) < INT_LIMIT else "is out of range (|value| must be < 2**62)"
    if typ is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"must be a number, got {type(value).__name__}"
        return None if math.isfinite(value) else "must be a finite number"
    if typ is str:
        return None if isinstance(value, str) else f"must be a string, got {type(value).__name__}"
    if get_origin(typ) is Literal:  # which name is `validate`'s to check, with every other rule
        return None if isinstance(value, str) else f"must be a string, got {type(value).__name__}"
    if get_origin(typ) is list:
        (item,) = get_args(typ)
        if not isinstance(value, list):
            return f"must be a list of {_type_name(item)}, got {type(value).__name__}"
        ok = all(_check(v, item) is None for v in value)
        return None if ok else f"must be a list of {_type_name(item)}"
    return f"has an unsupported type {typ}"


def _type_name(typ) -> str:
    if get_origin(typ) is Literal:
        return "one of " + ", ".join(map(repr, get_args(typ)))
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(typ, str(typ))


def _did_you_mean(word: str, options) -> str:
    """options: names, or {name: what to suggest for it}."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {(options[close[0]] if isinstance(options, dict) else close[0])!r}?)"


# ------------------------------------------------------------------------------------------ printing


def to_toml(cfg: Config, docs: bool = False) -> str:
    """The resolved recipe as TOML (written to every run directory; `--print-config` shows it)."""
    lines: list[str] = []
    for section in SECTIONS:
        _table(getattr(cfg, section), section, docs, lines)
    return "\n".join(lines)


def _table(obj, path: str, docs: bool, lines: list[str]) -> None:
    hints = get_type_hints(type(obj))
    lines.append(f"[{path}]" if not path.startswith("[") else path)
    nested, arrays = [], []
    for fl in dataclasses.fields(obj):
        value = getattr(obj, fl.name)
        if dataclasses.is_dataclass(value):
            nested.append((value, f"{path}.{fl.name}"))
            continue
        if isinstance(value, list) and value and all(dataclasses.is_dataclass(v) for v in value):
            arrays += [(v, f"[[{path}.{fl.name}]]") for v in value]  # after this table's keys, as TOML wants
            continue
        doc = fl.metadata.get("doc", "")
        typ = hints[fl.name]
        item = get_args(typ)[0] if get_origin(typ) is list else typ
        if get_origin(item) is Literal:
            doc = f"{' | '.join(get_args(item))}: {doc}" if doc else " | ".join(get_args(item))
        comment = f"  # {doc}" if docs and doc else ""
        lines.append(f"{fl.name} = {_toml_value(value)}{comment}")
    lines.append("")
    for value, header in arrays:
        _table(value, header, docs, lines)
    for value, sub in nested:
        _table(value, sub, docs, lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf" if v < 0 else "nan")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)
