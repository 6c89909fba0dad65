"""Any model by its ``--model`` spec: dtrain's own names, a user's function, or a transformers architecture.

The forms of a spec:

* a dtrain name (``cnn``, ``mlp``, ``gpt-small``, ...): built for the dataset's shape and classes;
* ``FILE.py:FN`` or ``MODULE:FN``: ``FN(**model_args)`` returns an ``nn.Module``, or ``(module, sample_batch)``
  (what ``dtrain plan`` has always taken; the sample is what the planner profiles);
* ``hf:TYPE`` (``hf:gpt2``, ``hf:llama``, ``hf:mistral``, ...): a Hugging Face transformers model built from
  ``AutoConfig.for_model(TYPE, **model_args)`` with random weights; nothing is downloaded;
* ``hf:DIR``: a local folder with ``config.json`` and, if it holds them, its weights (fine-tuning from disk);
  ``model_args`` override the folder's configuration.

A transformers model is built for the task the data sets: a causal language model for token windows (its
vocabulary is the data's unless ``vocab_size`` is given), an image or sequence classifier with the data's
classes for ``(x, label)`` pairs. Its cache of past keys and values is off (training has no use for it).

:func:`parameter_count` builds the model on the meta device, where nothing is allocated, so a model too large
for the machine is refused with its size before any memory is touched (transformers' default ``hf:llama``
has 6.7 billion parameters). Everything here raises :class:`~dtrain.errors.ConfigError` for what the user
gave: a missing file or function, a function that raises or returns no module, an unknown model argument,
transformers not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError

__all__ = ["is_builtin", "is_transformers", "build_spec", "parameter_count", "describe", "HF_EXTRA"]

HF_EXTRA = "pip install 'dtrain[hf]'"  # what installs transformers, tokenizers, Pillow and pyarrow


def is_builtin(spec: str) -> bool:
    """Whether ``spec`` is one of dtrain's own model names (not a function or a transformers model)."""
    return ":" not in spec


def is_transformers(spec: str) -> bool:
    """Whether ``spec`` names a transformers model (``hf:TYPE`` or ``hf:DIR``)."""
    return spec.startswith("hf:")


def describe(spec: str) -> str:
    """What kind of model ``spec`` is, for messages."""
    if is_transformers(spec):
        return f"transformers model {spec[3:]!r}"
    return f"model function {spec!r}" if not is_builtin(spec) else f"model {spec!r}"


# ---------------------------------------------------------------------------- a user's function


def load_function(spec: str, what: str = "model") -> Any:
    """The callable named by ``FILE.py:FN`` or ``MODULE:FN`` (ConfigError: no such file, module or function)."""
    where, sep, fn_name = spec.rpartition(":")
    if not sep or not where or not fn_name:
        raise ConfigError(f"{what} {spec!r}: give FILE.py:FUNCTION or MODULE:FUNCTION")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{what} file {where!r} does not exist")
        name = f"dtrain_user_{path.stem}"
        mod = sys.modules.get(name)
        if mod is None or getattr(mod, "__file__", None) != str(path):
            mod_spec = importlib.util.spec_from_file_location(name, path)
            if mod_spec is None or mod_spec.loader is None:
                raise ConfigError(f"{what} file {where!r} is not a Python module")
            mod = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = mod
            try:
                mod_spec.loader.exec_module(mod)
            except Exception as e:
                del sys.modules[name]
                raise ConfigError(f"{what} file {where!r} fails to import: {type(e).__name__}: {e}") from None
    else:
        try:
            mod = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"{what} module {where!r} cannot be imported: {e}") from None
    fn = getattr(mod, fn_name, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{what} {where} has no function {fn_name!r}")
    return fn


def _check_arguments(fn: Any, spec: str, args: Mapping[str, Any]) -> None:
    """Refuse model arguments that ``fn`` does not take (unless it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: let the call say
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(args) - named)
    if unknown:
        raise ConfigError(
            f"model {spec}: unknown model argument(s) {', '.join(unknown)}; "
            f"{spec.rpartition(':')[2]} takes {', '.join(sorted(named)) or 'none'}"
        )


def call_function(spec: str, args: Mapping[str, Any]) -> tuple[nn.Module, Any]:
    """``FN(**args)``: the module and the sample batch it returned with it (None when it returned a module)."""
    fn = load_function(spec)
    _check_arguments(fn, spec, args)
    try:
        out = fn(**args)
    except ConfigError:
        raise
    except Exception as e:
        if torch.get_default_device().type == "meta":
            raise  # a count on the meta device (parameter_count): the real build says what went wrong
        raise ConfigError(f"model {spec} raised {type(e).__name__}: {e}") from None
    sample = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module):
        out, sample = out
    if not isinstance(out, nn.Module):
        raise ConfigError(
            f"model {spec} returned a {type(out).__name__}, not an nn.Module (or a (module, sample_batch) pair)"
        )
    return out, sample


# ---------------------------------------------------------------------------- transformers


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"a transformers model (hf:...) needs the transformers library: {HF_EXTRA}") from None
    transformers.logging.set_verbosity_error()  # the configs' notes on ids outside a small vocabulary
    return transformers


def _hf_config(spec: str, args: Mapping[str, Any], *, task: str, num_classes: int, seq_len: int) -> Any:
    tf = _transformers()
    where = spec[3:]
    folder = Path(where).expanduser()
    if (folder / "config.json").is_file():
        base = tf.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        cls = type(base)
    elif where in tf.CONFIG_MAPPING:
        cls, base = tf.CONFIG_MAPPING[where], None
    else:
        raise ConfigError(
            f"model {spec}: {where!r} is neither a transformers model type (gpt2, llama, "
            "mistral, ...) nor a folder holding config.json"
        )
    known = set((base or cls()).to_dict()) | set(getattr(cls, "attribute_map", {}))
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(
            f"model {spec}: unknown model argument(s) {', '.join(unknown)} for "
            f"{cls.__name__}; see its fields with transformers.{cls.__name__}().to_dict()"
        )
    kw = dict(args)
    if task == "lm" and "vocab_size" not in kw and base is None:
        kw["vocab_size"] = num_classes  # the data's vocabulary (bytes: 256), not the architecture's default
    if task != "lm":
        kw.setdefault("num_labels", num_classes)
    try:  # through the constructor: it derives fields (a llama's head_dim from its width and heads)
        config = cls(**{**(base.to_dict() if base is not None else {}), **kw})
        config.use_cache = False
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model {spec}: {e}") from None
    positions = next(
        (
            getattr(config, k)
            for k in ("max_position_embeddings", "n_positions")
            if isinstance(getattr(config, k, None), int)
        ),
        None,
    )
    if task == "lm" and positions is not None and positions < seq_len:
        raise ConfigError(
            f"model {spec} takes {positions} positions, fewer than --seq-len {seq_len}; "
            f"set --model-arg max_position_embeddings={seq_len} or a shorter --seq-len"
        )
    return config


def _hf_model(
    spec: str, args: Mapping[str, Any], *, task: str, input_shape: tuple[int, ...], num_classes: int, seq_len: int
) -> nn.Module:
    tf = _transformers()
    config = _hf_config(spec, args, task=task, num_classes=num_classes, seq_len=seq_len)
    if task == "lm":
        auto = tf.AutoModelForCausalLM
    else:
        auto = tf.AutoModelForImageClassification if len(input_shape) == 3 else tf.AutoModelForSequenceClassification
    folder = Path(spec[3:]).expanduser()
    weights = any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))
    try:
        if weights and torch.get_default_device().type != "meta":
            model = auto.from_pretrained(str(folder), config=config, local_files_only=True)
        else:
            model = auto.from_config(config)
    except (ValueError, KeyError) as e:
        kind = "a causal language model" if task == "lm" else f"{auto.__name__[12:]} (labelled samples)"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"model {spec}: transformers builds no {kind} of it ({first}); train it on data of "
            "its kind (token windows: --dataset pytext or a text file)"
        ) from None
    if not isinstance(model, nn.Module):  # pragma: no cover - transformers always returns one
        raise ConfigError(f"model {spec}: transformers returned a {type(model).__name__}")
    return model


# ---------------------------------------------------------------------------- any spec


def build_spec(
    spec: str,
    model_args: Mapping[str, Any],
    *,
    task: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    seq_len: int = 64,
) -> tuple[nn.Module, Any]:
    """The module of a function or transformers spec, and the sample batch a function returned (or None).

    Args:
        spec: ``FILE.py:FN``, ``MODULE:FN``, ``hf:TYPE`` or ``hf:DIR``.
        model_args: keyword arguments of ``FN``, or fields of the transformers configuration.
        task: the data's task, ``"lm"`` or ``"classify"`` (what a transformers model is built for).
        input_shape: one sample's shape; num_classes: classes, or the vocabulary of token windows.
        seq_len: the data's window (a transformers language model must take that many positions).
    """
    if is_transformers(spec):
        return _hf_model(
            spec, model_args, task=task, input_shape=input_shape, num_classes=num_classes, seq_len=seq_len
        ), None
    return call_function(spec, model_args)


def parameter_count(spec: str, model_args: Mapping[str, Any], **data: Any) -> int | None:
    """Parameters of the model, counted on the meta device (nothing allocated; a tied tensor counted once).

    None where the function fails on the meta device (one that reads its tensors' values while it builds, or
    one that fails anywhere: the real build, which :mod:`dtrain.job.model_check` makes next, names its error);
    the errors of what the user gave (ConfigError: a missing file, an unknown argument) are raised as they are.
    """
    try:
        with torch.device("meta"):
            model, _ = build_spec(spec, model_args, **data)
    except ConfigError:
        raise
    except Exception:
        return None
    return sum(p.numel() for p in model.parameters())
