"""Chat templates rendered within bounds of time, output size and memory.

A chat template is code from a model's files (Jinja, as ``transformers`` renders it). Jinja's
sandbox already stops it from reaching Python objects, but not from running for ever (two nested
``range(100000)`` loops are 10^10 iterations) or from building gigabytes (``'x'.ljust(10**10)``,
a string doubled 40 times with ``~``). :func:`compile_template` compiles it in a sandbox that
also counts. Time: every loop iteration, call and filter looks at a deadline of
:data:`RENDER_SECONDS` per render. Size: whatever can make a long value at once (``*``, ``+``,
``~``, ``%``, ``**``, ``str.format``, the str methods ``ljust``, ``center``, ``zfill``,
``replace``, ``expandtabs``, ``join``, ``translate``, every filter, ``lipsum``) has the size of
its result estimated from its arguments before it runs, and is refused over
:data:`MAX_RENDERED_CHARS`; filters whose work grows faster than their input (``wordwrap``,
``striptags``, ``urlize``, ``pprint``) take at most :data:`_SLOW_FILTER_CHARS`. Memory: the
bytes of every value made (results of calls, filters, operators, slices, output) are added up
per render and refused over :data:`MAX_WORK_BYTES`, so no loop can keep building (a dict or a
list grown per iteration, many copies of a long string). The rendered text is cut off at
:data:`MAX_RENDERED_CHARS` and must be text (no lone surrogate). Each failure, and every error of
the template itself (bad syntax, an undefined name, its own ``raise_exception``), is one
:class:`~effijax.errors.ConfigError` naming ``chat_template``.
"""

from __future__ import annotations

import contextvars
import functools
import math
import re
import sys
import time
from collections.abc import Iterator

from effijax.errors import NO_VALUE, ConfigError

__all__ = ["RENDER_SECONDS", "MAX_RENDERED_CHARS", "MAX_WORK_BYTES", "TEMPLATE_HINT",
           "compile_template"]

# A real template renders a conversation in well under a millisecond; two seconds leave room
# for a slow machine and still end a runaway loop before a user wonders whether it hangs.
RENDER_SECONDS = 2.0
# A rendered conversation of more characters than this cannot be trained or generated from
# (no model here reads millions of tokens): 16 Mi characters, far above any real one. It also
# bounds any one value a template makes (a string, a list's items).
MAX_RENDERED_CHARS = 16 * 2**20
#: Bytes of values one render may make in all: a real template makes a few copies of the
#: conversation (at most 4 MiB a record); 256 MiB keeps a hostile one far below the machine's.
MAX_WORK_BYTES = 256 * 2**20
# Filters implemented in Python whose work grows faster than their input (textwrap slices a
# long word once per line; striptags' and urlize's regexes rescan): at most 64 Ki characters.
_SLOW_FILTER_CHARS = 2**16
_SLOW_FILTERS = frozenset({"wordwrap", "striptags", "urlize", "pprint"})
# Filters that write their value (or arguments) as text: its size is checked before they run.
_TEXT_FILTERS = frozenset({"string", "tojson", "escape", "e", "forceescape", "urlencode",
                           "xmlattr", "safe", "lower", "upper", "title", "capitalize", "trim",
                           "wordcount", "list", "reverse", "sort", "unique", "dictsort"})
# Loop iterations between two looks at the clock (a look costs about as much as 50 of them).
_CHECK_EVERY = 64
# The internal filters the parsed template is rewritten with (see _BoundedSandbox._parse):
# every for loop's iterable, every ``~`` and every ``{{ value }}`` pass through them.
_BOUNDED, _CONCAT, _OUT = "_effijax_bounded", "_effijax_concat", "_effijax_out"
# In a format string, the numbers (widths, precisions, field indices).
_NUMBERS = re.compile(r"\d+")
# Ints larger than this (bits) are refused as the result of ``*`` or ``**``.
_MAX_INT_BITS = 4096


class _Exceeded(Exception):
    """A render went over a bound; :meth:`BoundedTemplate.render` makes it a ConfigError."""


class _Budget:
    """One render's deadline and the bytes of the values it has made."""

    def __init__(self, seconds: float):
        self.deadline, self.used = time.monotonic() + seconds, 0


# None outside a render (compiling folds constants with the same checks, and no budget).
_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("_budget", default=None)


def _tick() -> None:
    budget = _budget.get()
    if budget is not None and time.monotonic() > budget.deadline:
        raise _Exceeded(f"rendering took more than {RENDER_SECONDS:g} s (a loop that does not "
                        "end, or one far too long)")


def _spend(nbytes: int) -> None:
    budget = _budget.get()
    if budget is None:
        return
    budget.used += nbytes
    if budget.used > MAX_WORK_BYTES:
        raise _Exceeded(f"the template made more than {MAX_WORK_BYTES // 2**20} MiB of strings "
                        "and lists while rendering (values built over and over in a loop)")


def _counted(value):
    """``value`` (a call's, filter's or operator's result) with its bytes spent; an iterator
    comes back counting its items and looking at the clock as it is consumed."""
    if isinstance(value, str | bytes | list | tuple | dict | set | frozenset):
        _spend(sys.getsizeof(value))
    elif isinstance(value, Iterator):
        return _items(value)
    return value


def _items(iterable, static: int = 0):
    """``iterable`` looking at the clock every few items and spending 8 bytes (a reference)
    plus ``static`` (the loop body's constant text) per item."""
    for i, item in enumerate(iterable):
        if not i % _CHECK_EVERY:
            _tick()
            _spend(_CHECK_EVERY * (8 + static))
        yield item


def _weight(value, limit: int = MAX_RENDERED_CHARS) -> int:
    """About ``len(str(value))``, stopping once over ``limit``: shared items are weighed once
    per occurrence without being walked again (``[[s] * 1000] * 1000`` costs 2,000 steps)."""
    seen: dict[int, int] = {}

    def weigh(v, depth: int) -> int:
        if isinstance(v, str):
            return len(v)
        if isinstance(v, bytes):
            return 4 * len(v) + 3
        if isinstance(v, bool) or v is None:
            return 5
        if isinstance(v, int):
            return v.bit_length() // 3 + 2
        if isinstance(v, float):
            return 24
        if isinstance(v, list | tuple | set | frozenset | dict):
            if id(v) in seen:
                return seen[id(v)]
            if depth > 100:  # str() of it would recurse as deep
                return limit + 1
            total = 2
            for item in (v.items() if isinstance(v, dict) else v):
                parts = item if isinstance(v, dict) else (item,)
                total += sum(weigh(p, depth + 1) + 4 for p in parts)
                if total > limit:
                    break
            seen[id(v)] = total
            return total
        return 64  # an object's repr (an Undefined, a namespace, a macro)

    return weigh(value, 0)


def _check(size: int, what: str) -> None:
    if size > MAX_RENDERED_CHARS:
        raise _Exceeded(f"{what} would make {size:,} characters, over {MAX_RENDERED_CHARS:,}")


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _check_counts(what: str, args) -> None:
    """Refuses an int argument (a width, a count) over :data:`MAX_RENDERED_CHARS`."""
    for value in args:
        if _int(value) > MAX_RENDERED_CHARS:
            raise _Exceeded(f"{what}: a width or count of {value:,} goes over "
                            f"{MAX_RENDERED_CHARS:,}")


def _format_size(fmt, args) -> int:
    """An upper bound of a ``%`` or ``str.format`` result's length: each of its fields is at
    most the largest number it names (a width) plus every argument's text."""
    numbers = [int(n) for n in _NUMBERS.findall(fmt) if len(n) < 12] or [0]
    if any(len(n) >= 12 for n in _NUMBERS.findall(fmt)):
        raise _Exceeded(f"the format {fmt[:40]!r} asks for a width over {MAX_RENDERED_CHARS:,}")
    fields = fmt.count("%") + fmt.count("{")
    each = max(numbers) + sum(_weight(a) for a in args)
    return len(fmt) + fields * each


def _replace_size(s, old, new, count=None) -> int:
    """At most how long ``s.replace(old, new, count)`` is (the replace filter makes ``old``
    and ``new`` text first: anything else counts as never found and as long as its text)."""
    found = isinstance(old, type(s)) and len(old) > 0
    n = s.count(old) if found else len(s) + 1
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        n = min(n, count)
    grows = (len(new) if isinstance(new, str | bytes) else _weight(new)) - (len(old) if found
                                                                           else 0)
    return len(s) + n * max(0, grows)


def _method_size(name: str, s, args, kwargs) -> int:
    """The length a str (or bytes) method ``name`` of ``s`` returns at most, from its
    arguments; 0 for a method that cannot write more than it reads."""
    values = [*args, *kwargs.values()]
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(len(s), _int(values[0]) if values else 0)
    if name == "replace" and len(args) >= 2:
        return _replace_size(s, *args[:3], **kwargs)
    if name == "expandtabs":
        tab = _int(values[0]) if values else 8
        return len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tab, 0)
    if name == "translate" and values and isinstance(values[0], dict):
        return len(s) * max([1, *(_weight(v) for v in values[0].values())])
    return 0


def _filter_size(name: str, value, args, kwargs) -> int:
    """The length filter ``name`` writes at most, from its value and arguments (see the
    module docstring); 0 when it writes no more than it is given."""
    values = [*args, *kwargs.values()]
    if name in _SLOW_FILTERS and _weight(value) > _SLOW_FILTER_CHARS:
        raise _Exceeded(f"the {name} filter is given more than {_SLOW_FILTER_CHARS:,} "
                        "characters (its work grows faster than its input)")
    if not isinstance(value, str):
        return _weight(value) if name in _TEXT_FILTERS | _SLOW_FILTERS else 0
    if name == "center":
        return max(len(value), _int(values[0]) if values else 80)
    if name == "indent":
        width = values[0] if values else 4
        return len(value) + (value.count("\n") + 1) * (len(width) if isinstance(width, str)
                                                        else _int(width))
    if name == "wordwrap":
        width = max(1, _int(values[0]) if values else 79)
        wrap = kwargs.get("wrapstring", args[2] if len(args) > 2 else None) or "\n"
        return len(value) + (len(value) // width + value.count("\n") + 1) * _weight(wrap)
    if name == "truncate":
        return len(value) + _weight(kwargs.get("end", args[2] if len(args) > 2 else "..."))
    if name == "format":
        return _format_size(value, values)
    if name == "replace" and len(args) >= 2:
        return _replace_size(value, *args[:3], **kwargs)
    return len(value)


def _join(values, separator) -> list:
    """``values`` as a list, after checking the length joining them with ``separator`` gives."""
    items = list(_items(values))
    _check(sum(_weight(i) for i in items) + _weight(separator) * max(0, len(items) - 1),
           "joining")
    return items


def _checked_filter(name: str, filter_):
    """Builtin filter ``name``, checking its result's size first, counting what it makes and
    looking at the clock (a filter such as ``slice`` or ``map`` may loop inside)."""
    from jinja2.utils import _PassArg

    skip = 0 if _PassArg.from_obj(filter_) is None else 1  # the context or environment first

    @functools.wraps(filter_)  # keeps Jinja's pass_* mark and async variant
    def checked(*args, **kwargs):
        _tick()
        value, rest = (args[skip] if len(args) > skip else None), args[skip + 1:]
        _check_counts(f"the {name} filter", [*rest, *kwargs.values()])
        if name == "join":
            value = _join(value, rest[0] if rest else kwargs.get("d", ""))
            args = (*args[:skip], value, *rest)
        else:
            _check(_filter_size(name, value, rest, kwargs), f"the {name} filter")
        return _counted(filter_(*args, **kwargs))

    return checked


def _check_binop(operator: str, left, right) -> None:
    """Refuses ``*``, ``**``, ``+`` and ``%`` whose result would be too large, before
    computing it."""
    if operator == "%" and isinstance(left, str):
        _check(_format_size(left, right if isinstance(right, tuple) else [right]),
               f"the format {left[:40]!r}")
    elif operator == "*":
        size, times = (_size(left), right) if _size(left) is not None else (_size(right), left)
        if size is not None and isinstance(times, int) and size * times > MAX_RENDERED_CHARS:
            raise _Exceeded(f"repeating a sequence of {size:,} items {times:,} times goes over "
                            f"{MAX_RENDERED_CHARS:,}")
        if (isinstance(left, int) and isinstance(right, int)
                and left.bit_length() + right.bit_length() > _MAX_INT_BITS):
            raise _Exceeded(f"a product of more than {_MAX_INT_BITS} bits")
    elif operator == "+" and _size(left) is not None and _size(right) is not None:
        _check(_size(left) + _size(right), "adding")
    elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
          and abs(left) > 1 and right * math.log2(abs(left)) > _MAX_INT_BITS):
        raise _Exceeded(f"{left} ** {right} has more than {_MAX_INT_BITS} bits")


def _size(value) -> int | None:
    return len(value) if isinstance(value, str | bytes | list | tuple) else None


def _checked_lipsum(lipsum):
    @functools.wraps(lipsum)
    def checked(n=5, html=True, min=20, max=100):  # noqa: A002 (Jinja's names)
        _check(_int(n) * (_int(max) + 1) * 16, "lipsum")  # a word and a space: < 16 chars
        return lipsum(n, html, min, max)

    return checked


def _sandbox():
    # Jinja is imported on first use: most runs never render a chat template.
    from jinja2 import nodes, pass_context
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    def filter_node(node, name, *args):
        return nodes.Filter(node, name, [nodes.Const(a) for a in args], [], None, None,
                            lineno=node.lineno)

    class _Rewrite(NodeTransformer):
        """Every for loop's iterable through _BOUNDED (with the bytes of constant text its
        body writes per iteration), every ``~`` through _CONCAT, every ``{{ value }}``
        through _OUT: what a template builds without calling anything."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            static = sum(len(d.data) for d in node.find_all(nodes.TemplateData))
            node.iter = filter_node(node.iter, _BOUNDED, static)
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return filter_node(nodes.Tuple(node.nodes, "load", lineno=node.lineno), _CONCAT)

        def visit_Output(self, node):
            node = self.generic_visit(node)
            node.nodes = [n if isinstance(n, nodes.TemplateData) else filter_node(n, _OUT)
                          for n in node.nodes]
            return node

    class _BoundedSandbox(ImmutableSandboxedEnvironment):
        """Jinja's immutable sandbox, with a clock, checked sizes and counted values."""

        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def _parse(self, source, name, filename):
            return _Rewrite().visit(super()._parse(source, name, filename))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
            _tick()
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            if isinstance(owner, str | bytes):
                if name == "join" and len(args) == 1 and not kwargs:
                    args = (_join(args[0], owner),)
                else:
                    _check_counts(f"str.{name}", [*args, *kwargs.values()])
                    _check(_method_size(name, owner, args, kwargs), f"str.{name}")
            return _counted(super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return _counted(super().call_binop(context, operator, left, right))

        def getitem(self, obj, argument):
            value = super().getitem(obj, argument)
            return _counted(value) if isinstance(argument, slice) else value

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None

            def checked(*args, **kwargs):  # str.format and format_map: the sizes first
                _check(_format_size(value.__self__, [*args, *kwargs.values()]),
                       f"the format {value.__self__[:40]!r}")
                return wrapped(*args, **kwargs)

            return checked

    def raise_exception(message):
        raise ValueError(message)

    @pass_context
    def bounded(context, iterable, static=0):
        return _items(iterable, static)

    @pass_context
    def concat(context, values):
        size = sum(_weight(v) for v in values)
        _check(size, "joining with ~")
        _spend(size)
        return "".join(map(str, values))

    @pass_context
    def out(context, value):
        size = _weight(value)
        _check(size, "a {{ value }}")
        _spend(size)
        return value

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.filters = {name: _checked_filter(name, f) for name, f in env.filters.items()}
    env.filters.update({_BOUNDED: bounded, _CONCAT: concat, _OUT: out})
    env.globals["lipsum"] = _checked_lipsum(env.globals["lipsum"])
    env.globals["raise_exception"] = raise_exception
    return env


#: How a template error ends: where the model's template comes from (a template given as a
#: file of its own, ``--chat-template``, says so instead).
TEMPLATE_HINT = ("; fix the template (tokenizer_config.json or chat_template.jinja) or the "
                 "conversation")


def _error(e: Exception) -> ConfigError:
    text = " ".join(str(e).split())  # one line: a template's own message may span several
    text = text if len(text) <= 300 else text[:297] + "..."
    kind = "" if isinstance(e, _Exceeded) else f"{type(e).__name__}: "
    return ConfigError("chat_template", NO_VALUE, f"the model's chat template failed ({kind}"
                       f"{text}){TEMPLATE_HINT}")


class BoundedTemplate:
    """A compiled chat template; :meth:`render` keeps to the module's bounds."""

    def __init__(self, template):
        self._template = template

    def render(self, **context) -> str:
        """The template rendered with ``context``.

        Raises:
          ConfigError: ``field="chat_template"``: the template failed, ran over
            :data:`RENDER_SECONDS` or wrote more than :data:`MAX_RENDERED_CHARS` characters.
        """
        token = _budget.set(_Budget(RENDER_SECONDS))
        try:
            pieces, size = [], 0
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise _Exceeded(f"the rendered text goes over {MAX_RENDERED_CHARS:,} "
                                    "characters")
                pieces.append(piece)
            text = "".join(pieces)
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise _Exceeded(f"the rendered text holds a lone surrogate ({text[e.start]!r} "
                                    f"at character {e.start:,}), which is not text") from None
            return text
        except Exception as e:  # any error of the template's code (RecursionError too)
            raise _error(e) from None
        finally:
            _budget.reset(token)


def compile_template(source: str) -> BoundedTemplate:
    """``source`` compiled in the bounded sandbox (``trim_blocks``, ``lstrip_blocks`` and a
    ``raise_exception`` global, as ``transformers`` compiles chat templates).

    Raises:
      ConfigError: ``field="chat_template"``: the template does not compile.

    Example:
      >>> compile_template("{% for m in messages %}{{ m }};{% endfor %}").render(
      ...     messages=["a", "b"])
      'a;b;'
      >>> loop = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
      >>> compile_template(loop).render()  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: chat_template: the model's chat template failed (rendering ...
      >>> compile_template("{{ 'x' * 10**9 }}").render()  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      effijax.errors.ConfigError: chat_template: ... 1 items 1,000,000,000 times goes over ...
    """
    try:
        return BoundedTemplate(_sandbox().from_string(source))
    except Exception as e:  # a syntax error, named by Jinja with its line
        raise _error(e) from None
