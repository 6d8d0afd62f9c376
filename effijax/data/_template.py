"""Chat templates rendered within bounds of time and output size.

A chat template is code from a model's files (Jinja, as ``transformers`` renders it). Jinja's
sandbox already stops it from reaching Python objects, but not from running for ever (two nested
``range(100000)`` loops are 10^10 iterations) or from writing gigabytes. :func:`compile_template`
compiles it in a sandbox that also counts: every loop iteration and every call checks a deadline
of :data:`RENDER_SECONDS` per render; repeating a string or list (``*``), raising to a power
(``**``), and widths (``%`` and ``str.format`` specs, ``center``, ``indent``, ``wordwrap``,
``truncate``, ``format``) are checked before they allocate; and the rendered text is cut off at
:data:`MAX_RENDERED_CHARS`. Each failure, and every error of the template itself (bad syntax,
an undefined name, its own ``raise_exception``), is one :class:`~effijax.errors.ConfigError`
naming ``chat_template``.
"""

from __future__ import annotations

import contextvars
import functools
import math
import re
import time

from effijax.errors import NO_VALUE, ConfigError

__all__ = ["RENDER_SECONDS", "MAX_RENDERED_CHARS", "TEMPLATE_HINT", "compile_template"]

# A real template renders a conversation in well under a millisecond; two seconds leave room
# for a slow machine and still end a runaway loop before a user wonders whether it hangs.
RENDER_SECONDS = 2.0
# A rendered conversation of more characters than this cannot be trained or generated from
# (no model here reads millions of tokens): 16 Mi characters, far above any real one.
MAX_RENDERED_CHARS = 16 * 2**20
# Loop iterations between two looks at the clock (a look costs about as much as 50 of them).
_CHECK_EVERY = 64
# The internal filter every for loop's iterable passes through (see _BoundedSandbox._parse).
_BOUNDED = "_effijax_bounded"
# Builtin filters that write as many characters as an argument says: checked before they run.
_WIDTH_FILTERS = ("center", "indent", "wordwrap", "truncate", "format")
# In a format string, a number of 9 digits: a width or precision of 100 million characters.
_WIDE = re.compile(r"\d{9,}")

_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("_deadline", default=math.inf)


class _Exceeded(Exception):
    """A render went over a bound; :meth:`BoundedTemplate.render` makes it a ConfigError."""


def _tick() -> None:
    if time.monotonic() > _deadline.get():
        raise _Exceeded(f"rendering took more than {RENDER_SECONDS:g} s (a loop that does not "
                        "end, or one far too long)")


def _bounded(iterable):
    for i, item in enumerate(iterable):
        if not i % _CHECK_EVERY:
            _tick()
        yield item


def _size(value) -> int | None:
    return len(value) if isinstance(value, str | bytes | list | tuple) else None


def _check_widths(text, args) -> None:
    """Refuses a width, a precision or a count that would write more than the cap at once:
    an int argument over :data:`MAX_RENDERED_CHARS`, or a number of 9 digits or more in a
    format string (``"%0999999999d"``, ``"{:>999999999}"``)."""
    for value in args:
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_RENDERED_CHARS:
            raise _Exceeded(f"a width or count of {value:,} goes over {MAX_RENDERED_CHARS:,}")
    if isinstance(text, str) and _WIDE.search(text):
        raise _Exceeded(f"the format {text[:40]!r} asks for a width over {MAX_RENDERED_CHARS:,}")


def _sized(name: str, filter_):
    """``filter_`` (a builtin filter with a width, such as ``center``) checking its widths
    first; the format filter's value is its format string."""

    @functools.wraps(filter_)  # keeps Jinja's pass_environment mark
    def checked(*args, **kwargs):
        _check_widths(args[0] if name == "format" else None, [*args[1:], *kwargs.values()])
        return filter_(*args, **kwargs)

    return checked


def _check_binop(operator: str, left, right) -> None:
    """Refuses ``*``, ``**`` and ``%`` whose result would be too large, before computing it."""
    if operator == "%" and isinstance(left, str):
        _check_widths(left, right if isinstance(right, tuple) else [right])
    elif operator == "*":
        size, times = (_size(left), right) if _size(left) is not None else (_size(right), left)
        if size is not None and isinstance(times, int) and size * times > MAX_RENDERED_CHARS:
            raise _Exceeded(f"repeating a sequence of {size:,} items {times:,} times goes over "
                            f"{MAX_RENDERED_CHARS:,}")
    elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
          and abs(left) > 1 and right * math.log2(abs(left)) > 4096):
        raise _Exceeded(f"{left} ** {right} has more than 4096 bits")


def _sandbox():
    # Jinja is imported on first use: most runs never render a chat template.
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _BoundedSandbox(ImmutableSandboxedEnvironment):
        """Jinja's immutable sandbox, with a clock on loops and calls and checked ``*``/``**``."""

        intercepted_binops = frozenset({"*", "**", "%"})

        def _parse(self, source, name, filename):
            # Every for loop iterates through _bounded, which looks at the clock: the one
            # place a template can spend time without calling anything.
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Filter(loop.iter, _BOUNDED, [], [], None, None,
                                         lineno=loop.iter.lineno)
            return tree

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
            _tick()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None

            def checked(*args, **kwargs):  # str.format and format_map: the widths first
                _check_widths(value.__self__, [*args, *kwargs.values()])
                return wrapped(*args, **kwargs)

            return checked

    def raise_exception(message):
        raise ValueError(message)

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.filters[_BOUNDED] = _bounded
    for name in _WIDTH_FILTERS:
        env.filters[name] = _sized(name, env.filters[name])
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
        token = _deadline.set(time.monotonic() + RENDER_SECONDS)
        try:
            pieces, size = [], 0
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise _Exceeded(f"the rendered text goes over {MAX_RENDERED_CHARS:,} "
                                    "characters")
                pieces.append(piece)
            return "".join(pieces)
        except Exception as e:  # any error of the template's code (RecursionError too)
            raise _error(e) from None
        finally:
            _deadline.reset(token)


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
