"""``convert``: gives an existing ``flax.nnx`` model its sites, without touching its parameters.

``convert(model)`` walks the model graph (attributes, ``nnx.List``/``nnx.Dict``, plain lists,
tuples and dicts held as ``nnx.data``) and replaces every ``nnx.Linear``, ``nnx.LinearGeneral``,
``nnx.Conv``, ``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.RMSNorm``, ``nnx.BatchNorm`` and
``nnx.MultiHeadAttention`` by the ``nan2safe_jax.nn`` module of the same name. The new module is
built abstractly (``nnx.eval_shape``: nothing is initialised) from the old one's configuration
and then given the old module's very ``nnx.Param`` objects (and its KV cache and dropout RNG
stream, a BatchNorm's running averages), so:

- no parameter is copied and none changes: ``nnx.state(model, nnx.Param)`` has the same paths,
  shapes, values and metadata before and after, so optimizer states and checkpoints of the
  parameters still fit, both ways;
- at FAST the outputs are flax's (``nan2safe_jax.nn`` computes what flax computes,
  tests/test_nn_flax_compat.py), and the gradients too (bit-for-bit with a concrete gear; a few
  ulps apart under a traced gear, see that test's module docstring);
- a layer inside an ``nnx.vmap``-stacked block (parameters with a leading layer axis ``[L]``)
  gets an ``[L]`` gear and ``[L, NUM_STATS]`` probes, so ``nnx.scan`` slices them per layer and
  tier 2 can put one layer in SAFE.

What is left alone is reported: flax layers with no ``nan2safe_jax.nn`` counterpart
(``ConvTranspose``, ``Dropout`` ...), convertible layers whose configuration the site does not
support (a custom ``dot_general`` or ``attention_fn``, cross-device norm statistics), and the user
modules whose own ``__call__`` code (hand-written attention, a loss in ``jnp``) runs outside
every site: tier 2 can name an equation there but no gear reaches it. Wrap such code in
``nan2safe_jax.nn.Site`` (see ``nan2safe_jax.user_site``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nan2safe_jax import nn as nn_lib
from nan2safe_jax.site import SiteGear, fill_defaults, name_sites, path_name

__all__ = ["ConvertReport", "Converted", "LeftAlone", "convert", "CONVERTIBLE"]

log = logging.getLogger(__name__)


def _linear_kwargs(m) -> dict:
    return dict(
        in_features=m.in_features,
        out_features=m.out_features,
        use_bias=m.use_bias,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        precision=m.precision,
        dot_general=m.dot_general,
        promote_dtype=m.promote_dtype,
        preferred_element_type=getattr(m, "preferred_element_type", None),
    )


def _linear_general_kwargs(m) -> dict:
    return dict(
        in_features=m.in_features,
        out_features=m.out_features,
        axis=m.axis,
        batch_axis=dict(m.batch_axis),
        use_bias=m.use_bias,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        precision=m.precision,
        promote_dtype=m.promote_dtype,
        dot_general=m.dot_general,
        dot_general_cls=m.dot_general_cls,
        preferred_element_type=getattr(m, "preferred_element_type", None),
    )


def _embed_kwargs(m) -> dict:
    return dict(
        num_embeddings=m.num_embeddings,
        features=m.features,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        promote_dtype=m.promote_dtype,
    )


def _norm_kwargs(m, bias: bool) -> dict:
    kw = dict(
        num_features=m.num_features,
        epsilon=m.epsilon,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        use_scale=m.use_scale,
        reduction_axes=m.reduction_axes,
        feature_axes=m.feature_axes,
        axis_name=m.axis_name,
        axis_index_groups=m.axis_index_groups,
        use_fast_variance=m.use_fast_variance,
        promote_dtype=m.promote_dtype,
    )
    if bias:
        kw["use_bias"] = m.use_bias
    return kw


def _attributes(*names: str):
    """The constructor arguments of a site that subclasses its flax layer (``nn.Conv``,
    ``nn.BatchNorm``): the same names, read off the flax layer's attributes."""
    return lambda m: {k: getattr(m, k) for k in names}


_batch_norm_kwargs = _attributes(
    "num_features",
    "use_running_average",
    "axis",
    "momentum",
    "epsilon",
    "dtype",
    "param_dtype",
    "use_bias",
    "use_scale",
    "axis_name",
    "axis_index_groups",
    "use_fast_variance",
    "promote_dtype",
)
_conv_kwargs = _attributes(
    "in_features",
    "out_features",
    "kernel_size",
    "strides",
    "padding",
    "input_dilation",
    "kernel_dilation",
    "feature_group_count",
    "use_bias",
    "mask",
    "dtype",
    "param_dtype",
    "precision",
    "conv_general_dilated",
    "promote_dtype",
    "preferred_element_type",
)


def _mha_kwargs(m) -> dict:
    return dict(
        num_heads=m.num_heads,
        in_features=m.in_features,
        qkv_features=m.qkv_features,
        out_features=m.out_features,
        num_kv_heads=m.num_kv_heads,
        in_kv_features=m.in_kv_features,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        broadcast_dropout=m.broadcast_dropout,
        dropout_rate=m.dropout_rate,
        deterministic=m.deterministic,
        precision=m.precision,
        use_bias=m.use_bias,
        attention_fn=m.attention_fn,
        decode=m.decode,
        normalize_qk=m.normalize_qk,
        qkv_promote_dtype=m.qkv_promote_dtype,
        out_promote_dtype=m.out_promote_dtype,
        ln_promote_dtype=m.ln_promote_dtype,
        qkv_dot_general=m.qkv_dot_general,
        out_dot_general=m.out_dot_general,
        qkv_dot_general_cls=m.qkv_dot_general_cls,
        out_dot_general_cls=m.out_dot_general_cls,
        keep_rngs=m.rngs is not None,
    )


# flax class -> (nan2safe_jax.nn class, constructor arguments read off the flax module,
# non-parameter attributes carried over as they are: KV cache, dropout RNG stream)
CONVERTIBLE: dict[type, tuple[type, Any, tuple[str, ...]]] = {
    nnx.Linear: (nn_lib.Linear, _linear_kwargs, ()),
    nnx.LinearGeneral: (nn_lib.LinearGeneral, _linear_general_kwargs, ()),
    nnx.Conv: (nn_lib.Conv, _conv_kwargs, ("mask",)),  # (an array: abstract in the site)
    nnx.Embed: (nn_lib.Embed, _embed_kwargs, ()),
    nnx.LayerNorm: (nn_lib.LayerNorm, lambda m: _norm_kwargs(m, True), ()),
    nnx.RMSNorm: (nn_lib.RMSNorm, lambda m: _norm_kwargs(m, False), ()),
    # the running averages (``nnx.BatchStat``) are shared, as the parameters are
    nnx.BatchNorm: (nn_lib.BatchNorm, _batch_norm_kwargs, ("mean", "var")),
    nnx.MultiHeadAttention: (
        nn_lib.MultiHeadAttention,
        _mha_kwargs,
        ("rngs", "cached_key", "cached_value", "cache_index"),
    ),
}


@dataclasses.dataclass(frozen=True)
class Converted:
    """One layer replaced by its site.

    Attributes:
      path: the layer's module path (``"blocks.attn"``).
      flax_class: the class it was (``"MultiHeadAttention"``; a subclass: ``"Linear (Dense)"``).
      sites: the site names tier 2 uses for it and its sub-sites (``name_sites`` names).
      stack: the leading layer axes of its parameters (``(L,)`` in an ``nnx.vmap`` stack).
    """

    path: str
    flax_class: str
    sites: tuple[str, ...]
    stack: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class LeftAlone:
    """A module ``convert`` did not turn into a site, and why (``reason``)."""

    path: str
    cls: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    """What ``convert`` did.

    Attributes:
      converted: the layers replaced by sites.
      left_alone: flax layers kept as they were (no counterpart, unsupported configuration,
        excluded), and user modules whose own code runs outside every site.
      sites: every site of the model after conversion, ``{name: gear shape}``.
    """

    converted: tuple[Converted, ...]
    left_alone: tuple[LeftAlone, ...]
    sites: dict[str, tuple[int, ...]]

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} layer(s) to sites:"]
        for c in self.converted:
            stack = f" stacked {list(c.stack)}" if c.stack else ""
            sites = ", ".join(c.sites)
            lines.append(f"  {c.path or '<root>'}: nnx.{c.flax_class}{stack} -> {sites}")
        done = {n for c in self.converted for n in c.sites}
        already = [n for n in self.sites if n not in done]
        if already:
            lines.append(f"already sites: {', '.join(already)}")
        lines.append(f"left alone {len(self.left_alone)}:")
        for a in self.left_alone:
            lines.append(f"  {a.path or '<root>'} ({a.cls}): {a.reason}")
        if any(a.reason == _USER_CODE for a in self.left_alone):
            lines.append(
                "(user code outside every site: tier 2 can name an equation there but no gear "
                "reaches it, and tier 1 has no probe there: what that code computes, an "
                "activation, a residual sum or a hand-written attention's logits, is not "
                "watched; wrap risky numerics in nan2safe.nn.Site)"
            )
        return "\n".join(lines)


_USER_CODE = "user code outside every site"


def _matches(patterns, path: str, module) -> bool:
    """A class matches instances; a string is an ``fnmatch`` pattern over path or class name."""
    for p in patterns:
        if isinstance(p, type):
            if isinstance(module, p):
                return True
        elif fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(type(module).__name__, p):
            return True
    return False


def _as_patterns(name: str, value) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, (str, type)):
        return (value,)
    if not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a class, a string or an iterable of them, got {value!r}")
    out = tuple(value)
    for p in out:
        if not isinstance(p, (str, type)):
            raise ValueError(
                f"{name}: entries must be classes or strings (path or class-name patterns), "
                f"got {p!r}"
            )
    return out


_CLASS_BOOKKEEPING = frozenset(
    {"__init__", "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__"}
    | {"__annotations__", "__firstlineno__", "__static_attributes__", "__orig_bases__"}
    | {"__parameters__", "__abstractmethods__", "_abc_impl", "__slots__"}
)


def _own_code(cls: type, methods_only: bool = False) -> list[str]:
    """What the non-flax classes of ``cls``'s MRO (a subclass, its mixins) define besides
    ``__init__``: methods, properties, class attributes, which a site would not have.
    ``methods_only``: the methods and properties alone, less dunders other than ``__call__``
    (code of the user's own: "user code outside every site")."""
    own = set()
    for c in cls.__mro__:
        if c is object or c.__module__.startswith("flax."):
            continue
        for k, v in vars(c).items():
            if k in _CLASS_BOOKKEEPING or k.startswith("_pytree__"):
                continue
            if methods_only and (
                not (callable(v) or isinstance(v, property))
                or (k.startswith("__") and k.endswith("__") and k != "__call__")
            ):
                continue
            own.add(k)
    return sorted(own)


def _convertible_base(cls: type) -> type | None:
    """The flax class of ``CONVERTIBLE`` that ``cls`` is or derives from (None: neither)."""
    return next((c for c in cls.__mro__ if c in CONVERTIBLE), None)


def _is_site(module) -> bool:
    return any(isinstance(v, SiteGear) for v in vars(module).values())


def _by_attr(node) -> bool:
    return isinstance(node, nnx.Module) and not isinstance(node, (nnx.List, nnx.Dict))


def _get(node, key):
    return getattr(node, key) if _by_attr(node) else node[key]


def _set(node, key, value) -> None:
    if _by_attr(node):
        setattr(node, key, value)
    else:
        node[key] = value


def _param_paths(module) -> dict[tuple, nnx.Variable]:
    return {tuple(p): v for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)}


def _shape(v: nnx.Variable) -> tuple[int, ...]:
    return tuple(jnp.shape(v.get_value()))


def _build(old, base: type) -> tuple[nnx.Module, tuple[int, ...]]:
    """The site for flax layer ``old`` (of class ``base`` or a subclass of it without code of
    its own), sharing its parameters; raises ValueError if it cannot."""
    cls, kwargs_of, carried = CONVERTIBLE[base]
    kwargs = kwargs_of(old)
    new = nnx.eval_shape(lambda: cls(**kwargs, rngs=nnx.Rngs(0)))  # validates, initialises nothing
    old_params, new_params = _param_paths(old), _param_paths(new)
    if set(old_params) != set(new_params):
        raise ValueError(
            f"parameter tree differs: flax has {sorted(map(path_name, old_params))}, the site "
            f"{sorted(map(path_name, new_params))}"
        )
    stack = None
    for path, var in old_params.items():
        want, have = _shape(new_params[path]), _shape(var)
        lead = have[: len(have) - len(want)]
        if have[len(lead) :] != want or (stack is not None and lead != stack):
            raise ValueError(
                f"parameter {path_name(path)} has shape {have}, expected {want} after the same "
                "leading (stack) axes as the other parameters"
            )
        stack = lead
    if stack is None:  # no parameter (a BatchNorm without scale and bias): its statistics
        for name in carried:
            have, want = getattr(old, name, None), getattr(new, name, None)
            if isinstance(have, nnx.Variable) and isinstance(want, nnx.Variable):
                h, w = _shape(have), tuple(getattr(want.get_value(), "shape", ()))
                stack = h[: len(h) - len(w)]
                break
    stack = stack or ()
    for path, var in old_params.items():
        parent = new
        for k in path[:-1]:
            parent = _get(parent, k)
        _set(parent, path[-1], var)  # the very Param object: shared, not copied
    for name in carried:
        setattr(new, name, getattr(old, name))
    if type(old) is not base:  # a subclass's own attributes ride along, unless they are state
        for k, v in vars(old).items():
            if k.startswith(("_pytree__", "_object__")) or hasattr(new, k):
                continue
            if isinstance(v, (nnx.Variable, nnx.Module, jax.Array)):
                raise ValueError(f"it holds {k!r}, which flax's {base.__name__} does not")
            setattr(new, k, v)
    fill_defaults(new, stack, fallback=0)  # gears FAST, knobs 1.0, probes empty, others 0
    return new, stack


def convert(
    model: nnx.Module,
    *,
    include: Any = None,
    exclude: Any = None,
    return_report: bool = False,
):
    """Replaces the model's flax layers by ``nan2safe_jax.nn`` sites sharing their parameters.

    Converts in place (containers and parent modules are updated) and returns the model: the
    same object unless ``model`` itself is a convertible layer. The report is logged at INFO
    (logger ``nan2safe_jax.convert``) and returned with ``return_report=True``.

    Args:
      model: a ``flax.nnx`` module.
      include: only convert layers matching one of these: classes (``nnx.LayerNorm``) or
        ``fnmatch`` patterns matched against the module path (``"blocks.*"``) or the class
        name (``"LayerNorm"``). None: every convertible layer.
      exclude: never convert layers matching one of these (same forms); they are reported.
      return_report: return ``(model, ConvertReport)`` instead of the model alone.

    Returns:
      The converted model, or ``(model, report)``.

    Raises:
      ValueError: ``model`` is not an ``nnx.Module``, or a bad ``include``/``exclude`` entry.
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
    inc, exc = _as_patterns("include", include), _as_patterns("exclude", exclude)
    converted: list[tuple[str, str, nnx.Module, tuple[int, ...]]] = []
    left: list[LeftAlone] = []
    memo: dict[int, Any] = {}

    first: dict[int, str] = {}  # id -> the path a shared layer was converted at

    def visit(value, path: tuple):
        key = id(value)
        if key in memo:
            new = memo[key]
            if new is not value and exc is not None and _matches(exc, path_name(path), value):
                left.append(
                    LeftAlone(
                        path_name(path),
                        type(value).__name__,
                        f"excluded, but shared with {first[key]}, where it was converted (one "
                        "layer is one site: exclude every path it has)",
                    )
                )
            return new
        memo[key] = value  # a cycle or a shared node sees itself until it is done
        new = _visit(value, path)
        memo[key] = new
        first.setdefault(key, path_name(path))
        return new

    def _visit(value, path):
        name = path_name(path)
        if isinstance(value, nnx.Module):
            # a site first: ``nn.Conv`` is a subclass of ``nnx.Conv``
            base = None if _is_site(value) else _convertible_base(type(value))
            if base is not None and type(value) is not base:
                own = _own_code(type(value))
                why = None
                if own:
                    why = (
                        f"a subclass of flax's {base.__name__} with code of its own "
                        f"({', '.join(own)}): not converted (a site would not run it); wrap "
                        "its numerics in nan2safe.nn.Site"
                    )
                elif inc is None or not _matches(inc, name, value):
                    why = (
                        f"a subclass of flax's {base.__name__}: converted only when include= "
                        "names it (the site replaces its class, which type-based code may read)"
                    )
                if why is not None:
                    left.append(LeftAlone(name, type(value).__name__, why))
                    return value
            if base is not None:
                if (inc is not None and not _matches(inc, name, value)) or (
                    exc is not None and _matches(exc, name, value)
                ):
                    left.append(LeftAlone(name, type(value).__name__, "excluded"))
                    return value
                try:
                    new, stack = _build(value, base)
                except ValueError as err:
                    left.append(LeftAlone(name, type(value).__name__, f"not converted: {err}"))
                    return value
                own = type(value).__name__
                shown = base.__name__ if own == base.__name__ else f"{base.__name__} ({own})"
                converted.append((name, shown, new, stack))
                return new
            if _is_site(value):
                return value  # already a site (nan2safe.nn module, nn.Site)
            mod = type(value).__module__
            if mod.startswith("flax.nnx.nn."):
                # Still gone through: flax's containers hold layers of their own (nnx.RNN's
                # cell, an LSTMCell's eight nnx.Linear), which convert as any others.
                left.append(
                    LeftAlone(name, type(value).__name__, "no nan2safe.nn counterpart (not a site)")
                )
            elif not mod.startswith("flax.") and _own_code(type(value), methods_only=True):
                left.append(LeftAlone(name, type(value).__name__, _USER_CODE))
            if isinstance(value, nnx.List):
                for i in range(len(value)):
                    _replace(value, i, path)
                return value
            if isinstance(value, nnx.Dict):
                for k in list(value.keys()):
                    _replace(value, k, path)
                return value
            for attr in list(vars(value)):
                if not attr.startswith(("_pytree__", "_object__")):
                    _replace(value, attr, path)
            return value
        if isinstance(value, list):
            for i in range(len(value)):
                _replace(value, i, path)
            return value
        if isinstance(value, dict):
            for k in list(value):
                _replace(value, k, path)
            return value
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            items = tuple(visit(v, path + (i,)) for i, v in enumerate(value))
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        return value

    def _replace(node, key, path):
        child = _get(node, key)
        if not isinstance(child, (nnx.Module, list, dict, tuple)):
            return
        new = visit(child, path + (key,))
        if new is not child:
            if _by_attr(node) and not isinstance(new, nnx.Module):
                new = nnx.data(new)
            _set(node, key, new)

    model = visit(model, ())
    sites = name_sites(model)
    done = []
    for path, cls, new, stack in converted:
        # The site's own name: a layer reached under two attributes is named by one of them.
        root = path and getattr(new, "site_name", path)
        names = tuple(n for n in sites if not root or n == root or n.startswith(root + "."))
        done.append(Converted(path, cls, names, stack))
    report = ConvertReport(tuple(done), tuple(left), sites)
    log.info("nan2safe.nn.convert:\n%s", report)
    return (model, report) if return_report else model
