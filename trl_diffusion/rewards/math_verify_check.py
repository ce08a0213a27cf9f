"""One math-verify check of a prediction against a gold answer, and a child process that runs it.

math-verify's timeouts use ``signal.alarm``, which only works in a main thread. :class:`MathAccuracyReward` called
from another thread sends each check to a child process (this file run as a script, line protocol of
:class:`~trl_diffusion.rewards.dllm_rl_math.SympyWorker`), where the timeouts work and which is killed if it hangs
anyway. Imports only the standard library, math-verify and sympy, so the child starts without loading
``trl_diffusion``.

Both sides are read as a reader reads them (:func:`plain_spacing`: ``1\\,000`` is 1000, which math-verify alone reads
as ``1 \\cdot 000``), and the rules see a number math-verify took as text (``\\text{18}``) as that number and a set
of assignments (``x = -2, x = 1``) as their right sides, as math-verify's comparison does.

On top of math-verify's ``verify``, a prediction must be an answer, not something math-verify can reduce to one
(each rule closes a way to score without solving the problem; see :func:`verify_source`):

* a boxed answer (and the gold answer) is read as a whole: when math-verify cannot parse all of it, it does not fall
  back to the last number or the last ``= ...`` inside it (``\\boxed{17 \\lor 18}``, ``\\boxed{x = 17 \\lor x = 18}``);
* no evaluation left to sympy that the gold answer does not use: ``\\binom``, ``!``, ``\\sum``, ``\\int``, ``\\lim``,
  floor / ceiling, ``\\log``, trigonometric functions, ``\\gcd`` / lcm, ``\\bmod``, ``\\det`` (and a ``vmatrix``),
  a matrix's trace / rank / norm, a transpose, arithmetic on matrices of numbers, ``|.|``, ``\\max`` / ``\\min``,
  ``\\gamma(n)`` (latex2sympy's Gamma function), an integer followed by another with only space between
  (latex2sympy's mixed number: ``17 25`` is 42) (copying ``\\dbinom{31}{28}``, ``\\log_2 64``, a sum of two vectors
  or a question's two addends is not an answer);
* a numeric gold answer (``18``, ``\\frac{1}{2}``, ``0.15``, ``25\\%``, ``9801\\pi``, or a set, tuple, interval or
  matrix of numbers: math-verify reads a pair ``(2, 5)`` as an interval) needs numbers, not arithmetic left to do
  (``99^2+99+1``, ``513^2 - 487^2``, ``\\sqrt{9801}``, ``1234/2``, ``99^2 \\pi``): a literal, a fraction in lowest
  terms, a decimal, a percentage, scientific notation, a root that is not rational, times a constant or a root;
* inside any answer, no arithmetic on numbers whose result the gold answer does not leave (``99^2 + i`` for
  ``9801 + i``, ``x \\le 99^2``, ``(3 + 4)x``, ``\\frac{4}{\\frac{1}{10}}``, ``\\frac{-6}{4}``, ``1234 : 2``,
  ``(3x)^2`` for ``9x^2``, ``\\sqrt{12}``, ``\\frac{4x + 6}{2}``, ``\\frac{6}{3(x + 2)}``), no root of a number in a
  denominator where the gold answer has none (``\\frac{6}{\\sqrt{3}}`` for ``2\\sqrt{3}``), and no product left to
  expand where the gold answer is expanded, or the other way round (``(x + 3)^2`` for ``x^2 + 6x + 9``,
  ``3(x + 2)`` for ``3x + 6``);
* no unknown when the gold answer has none (``\\frac{18x}{x}``);
* a decimal must agree with a small gold answer to about four significant digits, not only to math-verify's six
  decimal places (``0.0000001`` or ``0.0`` against ``10^{-8}``), also inside a set, tuple or matrix
  (``\\{5 \\times 10^{-19}\\}`` against ``1.6 \\times 10^{-19}``);
* an assignment answered for an assigned gold answer is judged by its value (``x = 99^2`` or ``99^2 = x`` for
  ``x = 9801``), as it is against the bare gold;
* an open interval is not the set of its two ends, which math-verify equals with it (``\\pm 3`` for ``-3 < x < 3``,
  ``x \\in \\{2, 7\\}`` for ``(2, 7)``, ``(-3, 3)`` for ``x = -3, x = 3``), and an equation whose left side is a sum of
  unknowns is not answered by its right side (``5`` for the line ``x + y = 5``);
* a relation of an unknown and a number (``x = 5``, ``x > 3``) is answered with the unknown alone on a side, not by
  an equation math-verify solves for it (the question's ``x + 1 = 6``);
* a tail math-verify drops as units (from the first ``\\text{`` of an answer ending in ``}``) holds no digit,
  bracket, separator or word of a hedge (``18 \\text{ or 17}`` was 18);
* a point's assignments are read in its coordinates' order (``y = -29, x = 15`` is ``(15, -29)``), not as written.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import unicodedata

__all__ = ["as_boxed", "boot_command", "parse_boxed", "verify_source"]


def parse_boxed(source: str, parsing_timeout: int | None) -> list:
    """math-verify's parse of an :func:`as_boxed` answer (a gold answer or a boxed prediction), read as a whole: its
    LaTeX only, and no value read from a part of it -- math-verify would otherwise fall back to the last number
    (``1, 2, \\ldots, 100`` -> 100, ``17 \\lor 18`` -> 18) or the last ``= ...`` of what it cannot parse. What it
    cannot read whole keeps only its text (which then only matches the same text)."""
    from math_verify import LatexExtractionConfig, parse

    parsed = parse(source, extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                   extraction_mode="first_match", parsing_timeout=parsing_timeout)
    return [p for p in parsed if isinstance(p, str) or _read_whole(p, parsed)]


def as_boxed(answer: str) -> str:
    r"""Wrap a bare answer as ``$\boxed{...}$`` so math-verify parses all of it as a single LaTeX answer, after
    :func:`plain_spacing`."""
    return "$\\boxed{" + plain_spacing(answer) + "}$"


# A number whose groups of three digits are set apart by a space: LaTeX's (``1\,234``, ``12\;345\;678``,
# ``1~000``), or one space character (``1 000``, a no-break or thin space).
_SPACE = r"(?:\\[,;: ]|\\thinspace(?![a-zA-Z])|~|[ \u00a0\u2009\u202f])"
_SPACED_DIGITS = re.compile(r"(?<![\d.])\d{1,3}(?:" + _SPACE + r"\d{3})+(?!\d)")
_DIGIT_SPACE = re.compile(_SPACE)


def plain_spacing(answer: str) -> str:
    r"""An answer as math-verify reads it right: digits of other scripts (full-width ``１８``, Arabic-Indic) written
    as ASCII digits (math-verify reads none of them; dLLM-RL's ``float()`` does), spaces between groups of three
    digits removed (math-verify reads ``1\,000`` as ``1 \cdot 000 = 0``, ``1\,234`` as ``1 \cdot 234``, and ``1 500``
    as the mixed number ``1 + 500``), other ``~`` (LaTeX's non-breaking space, ``18~\text{cm}``) made a space, and a
    degree sign ``°`` written ``^\circ``. None of these changes the value a reader sees."""
    answer = "".join(str(unicodedata.decimal(c)) if c.isdecimal() and not c.isascii() else c for c in answer)
    answer = _SPACED_DIGITS.sub(lambda match: _DIGIT_SPACE.sub("", match.group()), answer)
    return answer.replace("~", " ").replace("°", "^\\circ")


# A number whose groups of three digits are set apart by commas (``2,125``, ``10,\!080``, ``1{,}000``); a first
# group of 0 is a decimal comma (math-verify reads ``0,500`` as 0.5), not a thousands separator.
_COMMA_DIGITS = re.compile(r"(?<![\d.])[1-9]\d{0,2}(?:(?:,\\!\s*|\{,\}|,)\d{3})+(?![\d.])")
_COMMA = re.compile(r",\\!\s*|\{,\}|,")
_OPENERS = ("(", "[", "\\{", "\\lbrace", "\\langle")
_CLOSERS = (")", "]", "\\}", "\\rbrace", "\\rangle")


def join_thousands(answer: str) -> str:
    r"""Commas between groups of three digits removed (``x = 2,125`` -> ``x = 2125``). math-verify reads a bare
    ``2,125`` as 2125 but, inside a larger answer (``x = 2,125``, ``\textbf{2,125}``, ``2,125\%``), as the set
    ``{2, 125}``. Only for a gold answer that is one number, where a comma cannot separate two answers, and never
    for the whole content of brackets (``(1,125)``, ``\{1,125\}``: a pair, a set, an interval)."""

    def join(match: re.Match) -> str:
        before = answer[: match.start()].rstrip().rstrip("+-").rstrip()  # (-1,125): a sign, then the pair
        after = re.sub(r"^\\right\s*", "", answer[match.end():].lstrip())
        if before.endswith(_OPENERS) and after.startswith(_CLOSERS):
            return match.group()
        return _COMMA.sub("", match.group())

    return _COMMA_DIGITS.sub(join, answer)


def _one_number(gold_parsed: list) -> bool:
    """Whether the gold answer's parse is a single number (not a set, tuple, interval or expression)."""
    values = [_numerals_read(g) for g in gold_parsed if not isinstance(g, str)]
    return bool(values) and all(getattr(v, "is_number", False) and not getattr(v, "is_Relational", False)
                                for v in values)


# The subscript of a numeral (``52_8``, ``4210_{5}``, ``1A_{16}``, ``\text{AB}_{16}``, ``52 _ {(9)}``): its base.
# A subscript on a letter (``x_1``, ``P_1``, ``a_{n}``) is a name, not a base.
# ``_`` (after any LaTeX spacing: ``52\,_9`` is ``52_9`` to math-verify) and a group, command or character
_LATEX_SPACE = r"(?:\s|\\[,;:! ]|\\(?:quad|qquad|[a-z]*space|displaystyle|textstyle)(?![A-Za-z]))*"
_SUBSCRIPT = _LATEX_SPACE + r"_\s*(\{(?:[^{}]|\{[^{}]*\})*\}|\\[A-Za-z]+|[0-9A-Za-z])"
_BASE_SUBSCRIPT = re.compile(r"(?:(?<![0-9A-Za-z\\])\d[0-9A-Fa-f]*|\\(?:text|mathrm)\s*\{\s*[0-9A-Za-z]+\s*\})"
                             + _SUBSCRIPT)
# The gold's side: any subscript counts (a gold ``AB_{16}`` names base 16 without a ``\text``).
_ANY_SUBSCRIPT = re.compile(r"(?<=[0-9A-Za-z}])" + _SUBSCRIPT)
_SUBSCRIPT_NOISE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|boldsymbol|displaystyle|textstyle|overline|bf|rm)"
                              r"(?![A-Za-z])|\\[,;:! ]|[\s{}()~]")


def _bases(text: str, pattern: re.Pattern = _BASE_SUBSCRIPT) -> set[int | str]:
    r"""The bases written as subscripts of numerals in ``text`` (any subscript with :data:`_ANY_SUBSCRIPT`): a
    number where the subscript reads as one (``{(9)}``, ``\text{8}``, ``{ 9 }``), else its text (``{10-1}``, ``b``),
    which only matches the same text."""
    bases: set[int | str] = set()
    for subscript in pattern.findall(text):
        plain = _SUBSCRIPT_NOISE.sub("", subscript)
        bases.add(int(plain) if plain.isdigit() else plain)
    return bases


def _same_base(text: str, gold: str) -> bool:
    """A base subscript in the answer (the part math-verify compares: after the last ``=``) must be the gold
    answer's (base 10 where the gold has none): math-verify drops subscripts, so ``52_9`` and ``52_2`` matched a
    gold ``52_8``. An answer without a subscript is read as before."""
    written = _bases(_EQUATION_SPLIT.split(text)[-1])
    return written <= (_bases(gold, _ANY_SUBSCRIPT) or {10})


# Words of a hedge or a condition, which a unit never holds (18 \text{ or 17}, 18 \text{ if } n \text{ even}).
_HEDGE_WORDS = frozenset(("or", "and", "nor", "not", "no", "if", "unless", "else", "otherwise", "except", "but",
                          "when", "whenever", "where", "either", "neither", "maybe", "perhaps", "possibly", "probably",
                          "least", "most", "more", "less", "fewer", "than", "between"))


def _hedged_tail(answer: str) -> bool:
    """Whether math-verify's unit stripping would drop, from the first ``\\text{`` / ``\\mbox{`` of an answer ending
    in ``}`` to its end, more than units: a digit, a bracket, a separator or a word of a hedge (``18 \\text{ or 17}``
    was read as 18, ``18 \\text{ apples, or } 17 \\text{ apples}`` too)."""
    from latex2sympy2_extended.math_normalization import (
        NormalizationConfig,
        normalize_latex,
        unit_superscript_regex,
    )

    try:
        text = normalize_latex(answer, NormalizationConfig(basic_latex=True, units=False, malformed_operators=True,
                                                           nits=True, boxed="none"))
    except Exception:
        return False
    tail = unit_superscript_regex.search(text)
    if tail is None or not text[:tail.start()].strip():
        return False  # nothing is dropped, or the answer is text as a whole (\text{east})
    words = re.sub(r"\\[a-zA-Z]+", " ", tail.group(1))
    return bool(re.search(r"[\d,;:()\[\]=<>|]", words)
                or _HEDGE_WORDS & set(re.findall(r"[a-z]+", words.lower())))


def verify_source(source: str, gold_parsed: list, parsing_timeout: int | None, verify_timeout: int | None,
                  gold: str = "", answer_rules: bool = True) -> bool:
    """math-verify's verdict on one prediction, with the rules of the module docstring: ``source`` is an
    :func:`as_boxed` answer, or raw text to extract the answer from; ``gold`` is the bare gold answer (its LaTeX),
    ``gold_parsed`` its math-verify parse. ``answer_rules=False`` keeps only the first rule (a box is read whole)
    and math-verify's own comparison. ``False`` when it cannot be parsed, raises or runs out of time."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException
    from math_verify.utils import timeout

    try:
        if source.startswith("$\\boxed{"):
            text = source[len("$\\boxed{"):-len("}$")]
            if _one_number(gold_parsed):
                text = join_thousands(text)
                source = "$\\boxed{" + text + "}$"
            if answer_rules and not _same_base(text, gold):
                return False
            if answer_rules and _hedged_tail(text) and not _hedged_tail(gold):
                return False
            pred_parsed = parse_boxed(source, parsing_timeout)
        else:
            pred_parsed = parse(source, parsing_timeout=parsing_timeout)
            text = next((p for p in pred_parsed if isinstance(p, str)), "")
        if not pred_parsed:
            return False
        if not answer_rules:
            return bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout))
        checked = timeout(timeout_seconds=verify_timeout)(_admissible)
        pred_parsed = checked(pred_parsed, text, gold_parsed, gold)
        if not pred_parsed:
            return False
        rounding = timeout(timeout_seconds=verify_timeout)(_float_rounding)(gold_parsed)
        return bool(verify(gold_parsed, pred_parsed, float_rounding=rounding, timeout_seconds=verify_timeout))
    except (Exception, TimeoutException):
        return False


# ------------------------------------------------------------------------------------------ the prediction rules

# Operations a prediction may only use if the gold answer does: with them the question's own expression, copied
# into the box, is "equal" to the answer once sympy evaluates it. Matched in the LaTeX (sympy evaluates some of
# them while parsing, e.g. \binom and \gcd) and as sympy functions (the text of an unboxed answer is not known).
_OPERATION_LATEX = {
    "binomial": r"\\[dt]?binom(?![a-zA-Z])|\\choose(?![a-zA-Z])",
    "factorial": r"(?<!\\)!(?!=)|\\Gamma(?![a-zA-Z])|\\gamma\s*(?:\\left\s*)?[({]",  # latex2sympy's \gamma(5) is 24
    "sum": r"\\(?:sum|prod)(?![a-zA-Z])",
    "integral": r"\\i+nt(?![a-zA-Z])|\\oint(?![a-zA-Z])",
    "limit": r"\\lim(?![a-zA-Z])|\\lim(?:sup|inf)(?![a-zA-Z])",
    "derivative": r"\\partial(?![a-zA-Z])|\\[dt]?frac\s*\{\s*d[a-zA-Z]?\s*\}\s*\{\s*d[a-zA-Z]",
    "rounding": r"\\(?:operatorname\s*\{\s*)?[lr]?(?:floor|ceil)(?![a-zA-Z])",
    "logarithm": r"\\(?:operatorname\s*\{\s*)?(?:log|ln|lg)(?![a-zA-Z])",
    "trigonometric": r"\\(?:operatorname\s*\{\s*)?(?:arc)?(?:sin|cos|tan|cot|sec|csc)h?(?![a-zA-Z])",
    "gcd": r"\\gcd(?![a-zA-Z])|\b(?:gcd|lcm)\b",
    "modulo": r"\\bmod(?![a-zA-Z])",
    # a vmatrix, functions of a matrix and a transpose (A^T) are evaluated while parsing, like \det
    "determinant": r"\\det(?![a-zA-Z])|\\begin\s*\{\s*[vV]matrix\s*\}",
    "matrix operation": (r"\\operatorname\s*\{\s*(?:tr|trace|rank|norm|rref|nullspace|eig[a-z]*|diagonalize|svd|SVD"
                         r"|orth[a-z]*)\s*\}|\\end\s*\{[^{}]*\}\s*(?:\\right\s*)?[)\]]?\s*\^\s*\{?\s*"
                         r"(?:T|\\mathrm\s*\{\s*T\s*\})(?![a-zA-Z])"),
    "absolute value": r"\||\\[lr]?vert(?![a-zA-Z])",
    "max/min": r"\\(?:max|min)(?![a-zA-Z])",
    "division": r"\\div(?![a-zA-Z])|\u00f7|\u2215",  # 1234 \div 2 (or ÷, or the division slash) is 617 parsed
    "union": r"\\cup(?![a-zA-Z])",  # \{1, 2\} \cup \{3\} is \{1, 2, 3\} once parsed
}
_OPERATION_RE = {name: re.compile(pattern) for name, pattern in _OPERATION_LATEX.items()}


def _operations(text: str, parsed: list) -> set[str]:
    """The operations of :data:`_OPERATION_LATEX` used in an answer (its LaTeX and its sympy parse)."""
    import sympy

    found = {name for name, pattern in _OPERATION_RE.items() if pattern.search(text)}
    if _juxtaposed_integers(plain_spacing(text)):
        found.add("juxtaposed numbers")
    classes = {
        "binomial": (sympy.binomial,), "factorial": (sympy.factorial, sympy.factorial2, sympy.gamma),
        "sum": (sympy.Sum, sympy.Product), "integral": (sympy.Integral,), "limit": (sympy.Limit,),
        "derivative": (sympy.Derivative,), "rounding": (sympy.floor, sympy.ceiling),
        "logarithm": (sympy.log,), "modulo": (sympy.Mod,), "absolute value": (sympy.Abs,),
        "max/min": (sympy.Max, sympy.Min),
        "trigonometric": (sympy.functions.elementary.trigonometric.TrigonometricFunction,
                          sympy.functions.elementary.trigonometric.InverseTrigonometricFunction,
                          sympy.functions.elementary.hyperbolic.HyperbolicFunction),
    }
    for expr in parsed:
        if isinstance(expr, sympy.Basic):
            for node in sympy.preorder_traversal(expr):
                found.update(name for name, types in classes.items() if isinstance(node, types))
                if _matrix_arithmetic(node):
                    found.add("matrix operation")
    return found


# What renders as nothing or as space between two numbers (``17 \, 25``, ``17 \text{ } 25``, ``17 \phantom{0} 25``;
# ``~`` is a space already: ``plain_spacing``).
_BLANK = re.compile(r"\\(?:[hv]?phantom|hspace\*?|vspace\*?)\s*\{[^{}]*\}|\\(?:text|mbox|textrm|mathrm)\s*\{\s*\}"
                    r"|\\(?:displaystyle|textstyle|scriptstyle|quad|qquad|enspace|(?:neg)?(?:thin|med|thick)space)"
                    r"(?![a-zA-Z])|\\[,;:! ]")
_OPEN = r"(?:\\left\s*)?(?:\(|\[|\\\{|\\l(?:brace|brack)(?![a-zA-Z]))|\{"
_CLOSE = r"(?:\\right\s*)?(?:\)|\]|\\\}|\\r(?:brace|brack)(?![a-zA-Z]))|\}"
# An integer, bare or in up to two brackets of any kind (``25``, ``{25}``, ``(25)``, ``\left[ {25} \right]``).
_INTEGER = rf"(?:(?:{_OPEN})\s*(?:\{{\s*\d+\s*\}}|\d+)\s*(?:{_CLOSE})|\{{\s*\d+\s*\}}|\d+)"
_DEGREES = r"(?:\s*\^\s*(?:\\circ|\{\s*\\circ\s*\}))?"
_INTEGER_PAIR = re.compile(rf"""
    (?<![\d.]) {_INTEGER} {_DEGREES}           # an integer, in degrees or not
    (?: \s+                                     # then white space,
      | (?<=[}})\]]) \s*                        # or none after a closing bracket ({{17}}{{25}}),
      | \s* (?=[{{(\[]|\\left|\\lbrace|\\\{{) )   # or before an opening one (17(25))
    (?= {_INTEGER}                              # and another integer,
        (?! [\d._!] | \s*\^(?!\s*(?:\\circ|\{{\s*\\circ\s*\}})) ) )  # not a power's base (degrees are no power)
    """, re.VERBOSE)
# An integer then an improper fraction of integers (``17 \frac{25}{1}``): a mixed number no reader writes. Each of
# the fraction's parts is a braced integer or a single digit (``\frac{10x}{3}`` has no integer numerator).
_FRACTION_PART = r"(?:\{\s*(?:[{(]\s*)?([-+]?\s*\d+)\s*(?:[})]\s*)?\}|(\d))"
_IMPROPER_MIXED = re.compile(r"(?<![\d.])\d+\s*(?:(?:\\left\s*)?[{(]\s*)?\\[dtc]?frac\s*" + _FRACTION_PART + r"\s*"
                             + _FRACTION_PART)
# ... or written with a slash in brackets (``17 {25/1}``, ``17 (50/2)``).
_IMPROPER_SLASH = re.compile(r"(?<![\d.])\d+\s*[{(]\s*(\d+)\s*/\s*(\d+)\s*[})]")
# An integer in brackets then a fraction (``(600)\frac{35}{2}``): latex2sympy's mixed number, 600 + 35/2, where a
# reader multiplies.
_BRACKETED_MIXED = re.compile(rf"(?:{_OPEN})\s*\d+\s*(?:{_CLOSE})\s*\\[dtc]?frac(?![a-zA-Z])")
# What makes the first integer an argument, not a number of its own (``\frac 3 4``, ``2^3 3^2``, ``x_1 2``,
# ``f(2) 3``).
_ARGUMENT_OF = re.compile(r"(?:\\[dtc]?frac|\\[dt]?binom|\\sqrt|\^|_)\s*$|[A-Za-z]$")


def _juxtaposed_integers(text: str) -> bool:
    """Whether ``text`` writes an integer followed, with only space between, by another integer (or by an improper
    fraction of integers): latex2sympy reads an integer followed by a positive rational as a mixed number, their
    sum (``17 25``, ``{17} {25}``, ``30^\\circ 45``, ``17 \\frac{25}{1}`` are 42, 42, 75 and 42), which no reader
    does (a mixed number's fraction, ``3 \\frac{1}{2}``, is proper). An integer that is a command's argument
    (``\\frac 3 4``, ``2^3 3^2``) is not a number of its own. A base-10 subscript or a degree sign, which
    math-verify drops, does not part two integers (``17_{10} 25``)."""
    text = _NUMERAL_MARK.sub(" ", _BLANK.sub(" ", text))
    pairs = [match.start() for match in _INTEGER_PAIR.finditer(text)]
    pairs += [match.start() for match in _IMPROPER_MIXED.finditer(text)
              if not _proper(match[1] or match[2], match[3] or match[4])]
    pairs += [match.start() for match in _BRACKETED_MIXED.finditer(text)]
    pairs += [match.start() for match in _IMPROPER_SLASH.finditer(text) if int(match[1]) >= int(match[2])]
    return any(not _ARGUMENT_OF.search(text[:start]) for start in pairs)


def _proper(numerator: str, denominator: str) -> bool:
    """A mixed number's fraction: positive parts, unsigned, the numerator the smaller (``\\frac{-35}{-2}`` is not)."""
    return numerator.isdigit() and denominator.isdigit() and int(numerator) < int(denominator)


def _matrix_arithmetic(node) -> bool:
    """An operation on matrices of numbers left to sympy: a sum, product, multiple or power of written matrices
    (``\\begin{pmatrix} 3 \\\\ -7 \\end{pmatrix} + \\begin{pmatrix} -6 \\\\ 11 \\end{pmatrix}``). With an unknown it is
    an expression, judged as any other (a line's ``\\vec{a} + t \\vec{d}``)."""
    import sympy
    from sympy.core.relational import Relational

    if isinstance(node, (sympy.MatrixBase, sympy.MatrixSymbol, sympy.FiniteSet, sympy.Tuple, Relational)):
        return False  # a matrix, or a container or relation that holds one
    matrices = (sympy.MatrixBase, sympy.MatrixExpr)
    on_matrices = isinstance(node, sympy.MatrixExpr) or any(isinstance(arg, matrices) for arg in node.args)
    return on_matrices and not _free_symbols(node)


def _read_whole(expr, parsed: list) -> bool:
    """False if math-verify read only the part after the last ``=`` of a box it could not parse whole (its
    fallback for ``a = b = c`` chains): ``x = 17 \\lor x = 18`` would otherwise be read as 18."""
    from math_verify.grader import is_relation
    from math_verify.parser import get_last_eq

    latex = next((p for p in parsed if isinstance(p, str)), None)
    return latex is None or get_last_eq(latex) == latex or is_relation(expr)


def _admissible(pred_parsed: list, text: str, gold_parsed: list, gold: str) -> list:
    """``pred_parsed`` without the sympy values that break a rule for every gold value (its text stays: it only
    matches a gold answer written the same way). The rules read what math-verify compares: of an equation chain
    against a gold value, only its last side (``3! \\times 5! = 720`` is read as 720); the LaTeX both as written and
    as math-verify normalised it before parsing."""
    golds = [g for g in gold_parsed if not isinstance(g, str)]
    # the rules that read LaTeX read it as written and as math-verify parsed it, after deleting what it ignores
    # (\$, primes, \text{}, \displaystyle: \frac{1234'}{2} is parsed as \frac{1234}{2})
    texts = {text} | {p for p in pred_parsed if isinstance(p, str)}
    if any(map(_a_point, golds)):  # y = -29, x = 15 for (15, -29): judged and compared in the coordinates' order
        pred_parsed = [p if isinstance(p, str) else _as_point(p) for p in pred_parsed]
    return [p for p in pred_parsed
            if isinstance(p, str) or any(all(_passes(p, t, g, gold) for t in texts) for g in golds)]


def _a_point(expr) -> bool:
    """A tuple, or an open interval (which ``(2, 7)`` also writes): what a point's assignments are compared with."""
    import sympy

    return isinstance(expr, sympy.Tuple) or (isinstance(expr, sympy.Interval) and expr.left_open and expr.right_open)


# A point's coordinates in order, by the set of their names.
_COORDINATES = {frozenset(order): order for order in (("x", "y"), ("x", "y", "z"), ("r", "theta"),
                                                      ("r", "theta", "z"), ("rho", "theta", "phi"))}


def _as_point(expr):
    """Assignments to distinct coordinates (``y = -29, x = 15``, ``(y, x) = (-29, 15)``; x, y, z, r, θ, ρ, φ) as
    the point they name, its values in the coordinates' order (``(15, -29)``); else ``expr``. math-verify compares
    them with a point by the order they are written in, names aside: ``y = 15, x = -29`` matched ``(15, -29)``, the
    point (-29, 15)."""
    import sympy

    if isinstance(expr, sympy.Eq) and isinstance(expr.lhs, sympy.Tuple) and _a_point(expr.rhs):
        values = list(expr.rhs) if isinstance(expr.rhs, sympy.Tuple) else [expr.rhs.start, expr.rhs.end]
        if len(values) != len(expr.lhs):
            return expr
        pairs = list(zip(expr.lhs, values))
    elif (isinstance(expr, (sympy.FiniteSet, sympy.Tuple)) and len(expr.args) > 1
          and all(isinstance(e, sympy.Eq) for e in expr.args)):
        pairs = [(e.lhs, e.rhs) for e in expr.args]
    else:
        return expr
    names = [name.name if isinstance(name, sympy.Symbol) else None for name, _ in pairs]
    if None in names or len(set(names)) != len(names):
        return expr
    order = _COORDINATES.get(frozenset(names))
    if order is None:
        return expr  # other names (a question's (c, a)) keep math-verify's written order
    values = dict(zip(names, (value for _, value in pairs)))
    return sympy.Tuple(*(values[name] for name in order))


def _passes(pred, text: str, gold_expr, gold: str) -> bool:
    """Whether the sympy prediction ``pred`` (LaTeX ``text``) is an admissible answer for one gold value."""
    from math_verify.grader import is_assignment_relation, is_equation, is_relation, take_last_relation

    if not is_equation(pred) and is_assignment_relation(gold_expr) and _sum_assigned(gold_expr):
        return False  # 5 for x + y = 5 (a line): math-verify reads a left side of unknowns alone as an assignment
    if _unknown_against_number(gold_expr) and is_relation(pred) and not _unknown_alone(pred):
        return False  # x + 1 = 6 for x = 5, x - 1 > 2 for x > 3: math-verify solves both; the question's, unsolved
    if _interval_for_its_ends(_pair_kind(pred, text), _pair_kind(gold_expr, gold)):
        return False  # \pm 3 for -3 < x < 3, \{2, 7\} for (2, 7): math-verify equals an open interval and its ends
    gold_value, value, answer = _numerals_read(gold_expr), _numerals_read(pred), text
    solutions, gold_solutions = _assigned_values(value), _assigned_values(gold_value)
    if gold_solutions is None:
        gold_solutions = _assigned_value(gold_value)
    # an assigned gold answer is read by its values when the answer is an assignment too: x = 99^2 (or 99^2 = x,
    # \{x = 99^2\}, x = 99^2, y = 1) for x = 9801 meets the rules the bare 9801 sets
    if solutions is not None:
        value = solutions  # x = -2, x = 1 for -2, 1 (math-verify compares the right sides); every side is read
        if gold_solutions is not None:
            gold_value = gold_solutions
    elif _assigned_value(value) is not None and gold_solutions is not None:
        sides = _EQUATION_SPLIT.split(text)
        answer = sides[-1] if is_assignment_relation(value) else sides[0]  # the value's side: 99^2 of 99^2 = x
        value, gold_value = _assigned_value(value), gold_solutions
    elif is_equation(pred) and not is_equation(gold_expr):
        value, answer = take_last_relation(value).rhs, _EQUATION_SPLIT.split(text)[-1]
    elif is_assignment_relation(gold_expr) and not is_equation(pred):
        gold_value = take_last_relation(gold_value).rhs
    if solutions is None and not is_relation(pred) and _EQUATION_SPLIT.search(text):
        answer = _EQUATION_SPLIT.split(text)[-1]  # math-verify read the part after the last "="
    if _operations(answer, [value]) - _operations(gold, [gold_value]):
        return False  # an operation left to sympy: \binom{31}{28} for 4495
    if not _free_symbols(gold_value) and _free_symbols(value):
        return False  # an unknown in the answer to a question whose answer has none: \frac{18x}{x}
    if _numeric_gold(gold_value) and not _written_number(value):
        return False  # arithmetic left to do where the answer is a number: 99^2+99+1 for 9901 (or 99^2, 1)
    if _unreduced_fraction(answer) and not _unreduced_fraction(gold):
        return False  # a division latex2sympy did while parsing: 1234/2, 1234 : 2 or \frac{39204}{4} for 617, 9801
    gold_left = _arithmetic_left(gold_value)
    if any(all(left != done for done in gold_left) for left in _arithmetic_left(value)):
        return False  # arithmetic on numbers inside an expression: 99^2 + i for 9801 + i, x \le 99^2 for x \le 9801
    if _root_in_denominator(value) and not _root_in_denominator(gold_value):
        return False  # the "rationalise the denominator" question copied: \frac{6}{\sqrt{3}} for 2\sqrt{3}
    if _fraction_in_denominator(value) and not _fraction_in_denominator(gold_value):
        return False  # a complex fraction: \frac{1}{\frac{1}{x} + \frac{1}{y}} for \frac{xy}{x + y}
    if _reducible(value) and not _reducible(gold_value):
        return False  # a division left to do: \frac{x^4 - 1}{x - 1} for x^3 + x^2 + x + 1
    if (_factored(value) != _factored(gold_value) and not (is_equation(gold_expr) and is_equation(pred))
            and not _has_function(gold_value) and not _has_function(value)):
        # a product left to expand (x + 3)^2 for x^2 + 6x + 9, or the expansion for a factored gold answer: the
        # "expand" and "factor" questions copied; an equation may take either form (a circle's or a parabola's), and
        # a function may be written out (\frac{n(n - 1)}{2} for \binom{n}{2})
        return False
    if _power_of_power(value) and not _power_of_power(gold_value):
        return False  # exponent laws left to apply: (a^2 b)^3 for a^6 b^3
    if _less_simplified(value, gold_value):
        return False  # the question's expression, not simplified: 19x + 1 - 4x - 81 for 15x - 80
    return not _too_far(value, gold_value)  # 5 \times 10^{-19} for 1.6 \times 10^{-19}


def _unknown_alone(expr) -> bool:
    """A single relation with an unknown alone on a side (``x = 5``, ``5 = x``, ``3 < x``)."""
    import sympy

    return isinstance(expr, sympy.core.relational.Relational) and (expr.lhs.is_Symbol or expr.rhs.is_Symbol)


def _unknown_against_number(expr) -> bool:
    """A single relation of an unknown alone and a number (``x = 5``, ``x > 3``): an answer a relation matches only
    written the same way, not as an equation or inequality math-verify would solve for it."""
    return _unknown_alone(expr) and not (expr.rhs if expr.lhs.is_Symbol else expr.lhs).free_symbols


def _sum_assigned(expr) -> bool:
    """Whether an equation math-verify reads as an assignment (its left side holds unknowns only) has a sum on its
    left: ``x + y = 5`` is a line, and 5 is not its equation. A single unknown (``x = 5``), a function (``f(x) =
    2x``) or a product (``AB = 5``, a segment) keep math-verify's reading: their right side answers."""
    import sympy
    from math_verify.grader import take_first_relation

    return isinstance(take_first_relation(expr).lhs, sympy.Add)


# LaTeX that writes values as a set: braces, or a sign that stands for two values.
_SET_OF_VALUES = re.compile(r"\\\{|\\lbrace(?![a-zA-Z])|\\(?:pm|mp)(?![a-zA-Z])")


def _pair_kind(expr, latex: str) -> str | None:
    """What an answer that math-verify may compare with an open interval means (its sympy value ``expr``, its LaTeX
    ``latex``): ``"interval"`` (an inequality, or an open interval with an infinite end), ``"pair"`` (an open
    interval with finite ends, which ``(2, 7)`` also writes as a point), ``"values"`` (a set of values: written in
    braces or with ``\\pm``, or assignments to one unknown: ``x = -3, x = 3``, ``x = \\pm 3``), ``"list"`` (two
    values written bare: ``2, 7``, ``x = 2, y = 7``), else ``None``."""
    import sympy
    from math_verify.grader import is_equation, is_relation

    if isinstance(expr, sympy.Interval):
        if not (expr.left_open and expr.right_open):
            return None
        return "interval" if expr.start.is_infinite or expr.end.is_infinite else "pair"
    if is_relation(expr) and not is_equation(expr):
        return "interval"
    if isinstance(expr, sympy.Eq) and expr.lhs.is_Symbol and isinstance(expr.rhs, sympy.FiniteSet):
        return "values"  # x = \pm 3, x \in \{2, 7\}
    if not isinstance(expr, (sympy.FiniteSet, sympy.Tuple)) or len(expr.args) != 2:
        return None  # math-verify compares an open interval with two values only
    unknowns = {element.lhs for element in expr.args if isinstance(element, sympy.Eq)}
    if _SET_OF_VALUES.search(latex) or (len(unknowns) == 1 and all(isinstance(e, sympy.Eq) for e in expr.args)):
        return "values"
    return "list"


def _interval_for_its_ends(kind: str | None, gold_kind: str | None) -> bool:
    """Whether math-verify would equal an interval with a set of its two ends, where one side means the interval
    and the other values: a set of roots is not the open interval between them (``\\pm 3`` for ``-3 < x < 3``), and
    an inequality is not its boundary (``0, \\infty`` for ``x > 0``). A pair written bare for ``(2, 7)`` stays
    math-verify's: either may be a point."""
    kinds = {kind, gold_kind}
    return kinds in ({"values", "interval"}, {"values", "pair"}, {"list", "interval"})


def _numerals_read(expr):
    """``expr`` with each symbol that math-verify made of a number in text (``\\text{18}``, ``\\mathbf{-3}``: a
    symbol named ``18``) read as that number, which math-verify's comparison already does."""
    import sympy

    try:
        named = {symbol: sympy.Number(symbol.name) for symbol in expr.free_symbols
                 if _NUMERAL.fullmatch(symbol.name)}
        return expr.xreplace(named) if named else expr
    except Exception:
        return expr


_NUMERAL = re.compile(r"-?\d+(?:\.\d+)?")


def _assigned_values(expr):
    """The values of a set or tuple of assignments (``x = -2, x = 1``; ``x = 15, y = -29``; either way round), in
    the same kind of container, else ``None``."""
    import sympy

    if not isinstance(expr, (sympy.FiniteSet, sympy.Tuple)) or not expr.args:
        return None
    values = [_assigned_value(element) for element in expr.args]
    return None if any(v is None for v in values) else type(expr)(*values)


def _assigned_value(expr):
    """The value an assignment gives, written either way round (``x = 5``, ``5 = x``; of a chain, its last side),
    else ``None``."""
    import sympy
    from math_verify.grader import is_assignment_relation, take_last_relation

    if is_assignment_relation(expr):
        return take_last_relation(expr).rhs
    if isinstance(expr, sympy.Eq) and expr.rhs.is_Symbol and not expr.lhs.free_symbols:
        return expr.lhs
    return None


# A fraction of two integers, as \frac (\dfrac, \tfrac, \cfrac; braced or single-digit parts), with a slash, as a
# ratio or with \over: latex2sympy evaluates each while parsing (``1234 : 2`` is 617). Read after
# :func:`_bare_integers`, so each integer is bare or in one pair of braces.
_FRACTION_ARGUMENT = r"(?:\{([-+]?\d+)\}|(\d))"
_SLASH_ARGUMENT = r"(?:\{([-+]?\d+)\}|(?<![\d.])([-+]?\d+)(?![\d.]))"
_INTEGER_FRACTION = re.compile(rf"\\[dtc]?frac\s*{_FRACTION_ARGUMENT}\s*{_FRACTION_ARGUMENT}"
                               rf"|{_SLASH_ARGUMENT}\s*(?:[/:]|\\over(?![a-zA-Z]))\s*{_SLASH_ARGUMENT}")
# An integer alone in brackets of any kind (``{{12}}``, ``(12)``, ``\left(12\right)``).
_BRACKETED_INTEGER = re.compile(rf"(?:{_OPEN})\s*(?:\{{([-+]?\d+)\}}|([-+]?\s*\d+))\s*(?:{_CLOSE})")


# A base-10 subscript or a degree sign on an integer, which math-verify drops (``1234_{10}``, ``1234_{(10)}``,
# ``1234^\circ``).
_NUMERAL_MARK = re.compile(r"(?<=\d)\s*(?:_\s*(?:\{\s*\(?\s*10\s*\)?\s*\}|10(?!\d))|\^\s*(?:\{\s*\\circ\s*\}|\\circ))")


def _bare_integers(text: str) -> str:
    """``text`` with each integer alone in brackets written ``{n}``: ``\\frac{(12)}{{4}}`` and ``\\left(12\\right)/4``
    read as ``\\frac{12}{4}`` and ``{12}/4``."""
    previous = None
    while previous != text:
        previous, text = text, _BRACKETED_INTEGER.sub(lambda m: "{" + "".join((m[1] or m[2]).split()) + "}", text)
    return text


def _unreduced_fraction(text: str) -> bool:
    """A fraction of integers in ``text`` that is not in lowest terms (``\\frac{6}{4}``, ``1234/2``, ``\\frac{8}{1}``,
    ``1234 : 2``, ``{1234 \\over 2}``): a division left to do, which the parse shows only as its result. A slash
    after a power, subscript or name divides more than the integer (``x^{12}/4``)."""
    text = _bare_integers(_NUMERAL_MARK.sub(" ", _BLANK.sub(" ", text)))
    for match in _INTEGER_FRACTION.finditer(text):
        if match[1] or match[2]:
            numerator, denominator = match[1] or match[2], match[3] or match[4]
        elif _ARGUMENT_OF.search(text[:match.start()]):
            continue
        else:
            numerator, denominator = match[5] or match[6], match[7] or match[8]
        if abs(int(denominator)) == 1 or math.gcd(int(numerator), int(denominator)) > 1:
            return True
    return False


# "=" as math-verify splits equation chains (not <=, >=, !=), and "\equiv", which it reads as "=".
_EQUATION_SPLIT = re.compile(r"(?<!\\|<|!|>)=|\\equiv(?![a-zA-Z])")


def _arithmetic_left(expr) -> list:
    """The results of the operations on numbers that ``expr`` leaves to do: arithmetic with a rational result
    (``99^2``, ``2 \\cdot 3``, ``5 - 3``, ``\\frac{4}{\\frac{1}{10}}``, ``\\sqrt{9801}``), the numbers of a power of a
    product (the 9 of ``(3x)^2``), a radical not simplified (``\\sqrt{48}``, ``\\sqrt{2}\\sqrt{6}``) and a fraction
    whose numerator's terms share a factor with its denominator (``\\frac{4x + 6}{2}``, ``\\frac{2 + 2\\sqrt{5}}{4}``).
    An answer may leave only results its gold answer leaves, written in any form (``2^{-10}`` for
    ``\\frac{1}{2^{10}}``). A number in lowest terms, a sign, a reciprocal of an integer (``\\frac{x}{3}``) and a power
    of ten (``1.6 \\times 10^{-19}``, ``\\frac{1}{10^3}``) are written numbers, not operations."""
    import sympy

    found: list = []

    def visit(node) -> None:
        value = _rational_value(node)
        if value is not None:
            if not _written_rational(node):
                found.append(value)
            return
        if isinstance(node, sympy.MatrixBase):
            parts = list(node)
        elif isinstance(node, (sympy.Add, sympy.Mul)):
            parts = _flattened(node, type(node))
            numbers = [part for part in parts if _rational_value(part) is not None]
            if node.is_Mul:  # and a denominator's numbers: the 6 and the \frac{1}{3} of \frac{6}{3(x + 2)}
                numbers += [sympy.Pow(number, -1, evaluate=False) for part in parts
                            if part.is_Pow and part.exp == -1 and part.base.is_Mul and _rational_value(part) is None
                            for number in _flattened(part.base, sympy.Mul)
                            if _rational_value(number) is not None and number not in (1, -1)]
            combined = node.func(*numbers, evaluate=False)  # 2 \cdot 3 of 2 \cdot 3 x, 3 + 4 of 3 + 4 + \sqrt{2}
            if len(numbers) > 1 and not _written_rational(combined):
                found.append(_rational_value(combined))
            roots = [part for part in parts if _root(part) is not None]
            if node.is_Mul and len(roots) > 1:
                found.append(sympy.Mul(*roots))  # \sqrt{2}\sqrt{6} is 2\sqrt{3}
            if node.is_Mul and _shared_factor(node):
                found.append(sympy.expand(node))
        elif isinstance(node, sympy.Pow):
            parts = list(node.args)
            root = _root(node)
            if root is not None and (root.is_Mul or (root.is_Pow and root.exp.q < node.exp.q)):
                found.append(root)  # \sqrt{48} is 4\sqrt{3}, \sqrt[4]{4} is \sqrt{2} (\sqrt[3]{4} is written)
            power = _power_of_numbers(node)
            if power is not None:
                found.append(power)
        else:
            parts = list(node.args) if isinstance(node, sympy.Basic) else []
        for part in parts:
            visit(part)

    try:
        visit(expr)
    except Exception:
        return []
    return found


def _in_denominator(expr, sought) -> bool:
    """Whether a denominator of ``expr`` (a negative power's base; not inside an exponent or a function's argument)
    has a part that ``sought`` accepts, read through sums, products and powers' bases."""
    import sympy

    def within(node) -> bool:
        parts = [node.base] if node.is_Pow else node.args if node.is_Add or node.is_Mul else []
        return sought(node) or any(map(within, parts))

    def walk(node) -> bool:
        if isinstance(node, sympy.MatrixBase):
            return any(map(walk, node))
        if isinstance(node, sympy.Pow):
            return (node.exp.is_negative and within(node.base)) or walk(node.base)
        if isinstance(node, sympy.Function) or not isinstance(node, sympy.Basic):
            return False
        return any(map(walk, node.args))

    try:
        return walk(expr)
    except Exception:
        return False


def _root_in_denominator(expr) -> bool:
    """A root of a number, or of a number times an unknown, in a denominator (``\\frac{6}{\\sqrt{3}}``,
    ``\\frac{2}{1 + \\sqrt{3}}``, ``\\frac{6}{\\sqrt{3x}}``): a denominator left to rationalise."""
    import sympy

    def root_of_number(node) -> bool:  # \sqrt{3}, or a root of a number times an unknown: \sqrt{3x}, \sqrt{2\pi}
        if _root(node) is not None:
            return True
        return (node.is_Pow and node.exp.is_Rational and not node.exp.is_Integer and node.base.is_Mul
                and any(_rational_value(f) not in (None, 1, -1) for f in _flattened(node.base, sympy.Mul)))

    return _in_denominator(expr, root_of_number)


def _fraction_in_denominator(expr) -> bool:
    """A fraction inside a denominator (``\\frac{1}{\\frac{1}{x} + \\frac{1}{y}}``, ``\\frac{x}{1 + \\frac{1}{x}}``): a
    complex fraction left to simplify."""
    return _in_denominator(expr, lambda node: node.is_Pow and node.exp.is_negative)


def _fraction_parts(node) -> tuple | None:
    """The numerator and denominator of a product with one reciprocal factor (``x + 2`` and ``2x`` of
    ``\\frac{x + 2}{2x}``), else ``None``."""
    import sympy

    parts = _flattened(node, sympy.Mul) if node.is_Mul else [node]
    below = [part for part in parts if part.is_Pow and part.exp == -1]
    if len(below) != 1:
        return None
    return sympy.Mul(*[part for part in parts if part is not below[0]]), below[0].base


def _reducible(expr) -> bool:
    """A fraction whose numerator and denominator share a factor, a polynomial or a number (``\\frac{x^4 - 1}{x - 1}``,
    ``\\frac{(x + 1)^4}{x + 1}``, ``\\frac{(3x + 3)^2}{9}``): a division left to do."""
    import sympy

    def shares(node) -> bool:
        fraction = _fraction_parts(node)
        if fraction is None:
            return False
        shared = sympy.gcd(*map(sympy.expand, fraction))
        # a polynomial, an integer, e or \pi; not a constant sympy finds in both (1/log(10) of \frac{\log 5}{\log 3})
        constant = shared.atoms(sympy.NumberSymbol)
        return bool(_free_symbols(shared) or constant) or (shared.is_Integer and abs(shared) != 1)

    try:
        return any(node.is_Mul and shares(node) for node in sympy.preorder_traversal(expr))
    except Exception:
        return False


def _root(expr):
    """The value of a root of a positive integer or fraction (``\\sqrt{48}``: ``4\\sqrt{3}``, ``8^{3/2}``,
    ``48^{-1/2}``, ``\\sqrt{\\frac{3}{4}}``: ``\\frac{\\sqrt{3}}{2}``), else ``None``."""
    import sympy

    if isinstance(expr, sympy.Pow) and expr.base.is_Rational and expr.base > 0 and expr.exp.is_Rational:
        return None if expr.exp.is_Integer else sympy.Pow(expr.base, expr.exp)
    return None


def _power_of_numbers(expr):
    """The power of the numbers of a product raised to a power (9 for ``(3x)^2``, 1/4 for ``(\\frac{x}{2})^2``,
    ``4\\sqrt{3}`` for ``\\sqrt{48x}``): arithmetic the product's power leaves to do. ``None`` for another power, a
    product without such numbers, or a root with nothing to take out (``\\sqrt{2x}``)."""
    import sympy

    base, exponent = expr.args
    if not isinstance(base, sympy.Mul) or _rational_value(exponent) is None or exponent in (1, -1):
        return None
    numbers = [f for f in _flattened(base, sympy.Mul) if _rational_value(f) is not None]  # the sign too: (-x)^2
    if not numbers:
        return None
    power = sympy.Pow(sympy.Mul(*numbers, evaluate=False), exponent, evaluate=False)
    value = _rational_value(power)
    if value is not None:
        return value
    root = _root(sympy.Pow(_rational_value(power.base), _rational_value(exponent), evaluate=False))
    return root if root is not None and root.is_Mul else None


def _power_of_power(expr) -> bool:
    """A whole power of a product or of a power (``(ab)^3``, ``(x^2)^3``, ``(\\pi^2)^2``): exponent laws left to
    apply."""
    import sympy

    try:
        return any(isinstance(node, sympy.Pow) and node.exp.is_Integer and node.exp not in (1, -1)
                   and isinstance(node.base, (sympy.Mul, sympy.Pow)) for node in sympy.preorder_traversal(expr))
    except Exception:
        return False


def _shared_factor(product) -> bool:
    """Whether a product's numbers have a denominator that shares a factor with every term of a sum in it
    (``\\frac{4x + 6}{2}``, ``\\frac{1}{2}(4x + 6)``, ``\\frac{2 + 2\\sqrt{5}}{4}``): a fraction left to reduce."""
    import sympy

    value = _coefficient(product)
    if value is None or not value.is_Rational:
        return False
    for part in _flattened(product, sympy.Mul):
        if isinstance(part, sympy.Add):
            coefficients = [_coefficient(term) for term in part.args]
            if all(c is not None and c.is_Integer for c in coefficients):
                if math.gcd(value.q, *(int(c) for c in coefficients)) > 1:
                    return True
    return False


def _coefficient(term):
    """The product of a term's numbers (4 of ``4x``, 6 of ``6``, 1 of ``x``, 1/2 of ``\\frac{4x + 6}{2}``); ``None``
    if it cannot be computed."""
    import sympy

    factors = _flattened(term, sympy.Mul) if term.is_Mul else [term]
    return _rational_value(sympy.Mul(*[f for f in factors if _rational_value(f) is not None], evaluate=False))


def _factored(expr) -> bool:
    """A power of a sum (``(x + 3)^2``, ``(1 + \\sqrt{2})^2``), a product of two sums (``(2x + 1)(x - 3)``) or of a sum
    with an unknown and another factor with one (``x(x + 3)``, ``3x(2x + 5)``) outside a denominator
    (``\\frac{2}{(x - 1)(x + 1)}`` is a fraction as written), or a term of the answer that is an integer other than a
    sign times a polynomial with an unknown (``3(x + 2)``; not ``\\frac{3(x + 1)}{2}``, ``2(2^n - 1)``,
    ``\\sqrt{2(x + 1)}``): a product left to expand, or a factored answer."""
    import sympy
    from sympy.core.relational import Relational

    def unknown_factor(part) -> bool:
        return not part.is_Add and bool(_free_symbols(part)) and not (part.is_Pow and part.exp.is_negative)

    def factored(node) -> bool:
        if isinstance(node, sympy.Pow) and node.exp.is_negative:
            return False
        if isinstance(node, sympy.Pow) and node.base.is_Add and node.exp.is_Integer and node.exp > 1:
            return True
        if isinstance(node, sympy.Mul):
            parts = _flattened(node, sympy.Mul)
            sums = [part for part in parts if part.is_Add]
            if len(sums) > 1 or (any(_free_symbols(part) for part in sums) and any(map(unknown_factor, parts))):
                return True
        if isinstance(node, sympy.MatrixBase):
            return any(map(factored, node))
        return isinstance(node, sympy.Basic) and any(factored(arg) for arg in node.args)

    def terms(node) -> list:  # through sums, relations, sets, tuples, intervals, matrices; not products or powers
        if isinstance(node, sympy.MatrixBase):
            return [term for entry in node for term in terms(entry)]
        if isinstance(node, (sympy.Add, Relational, sympy.FiniteSet, sympy.Tuple, sympy.Interval)):
            return [term for arg in node.args for term in terms(arg)]
        return [node]

    def distributes(term) -> bool:  # the 3 of 3(x + 2), \frac{3(x + 2)}{1}, 3.0(x + 2)
        parts = [part.base if part.is_Pow and part.exp == 1 else part
                 for part in (_flattened(term, sympy.Mul) if term.is_Mul else [])]
        coefficient = _coefficient(term) if parts else None
        polynomials = [part for part in parts if part.is_Add and part.free_symbols
                       and part.is_polynomial(*part.free_symbols)]
        return (coefficient is not None and coefficient.is_Number and coefficient % 1 == 0 and abs(coefficient) > 1
                and bool(polynomials) and not any(part.is_Pow and part.exp.is_negative and _free_symbols(part.base)
                                                  for part in parts))

    try:
        return factored(expr) or any(map(distributes, terms(expr)))
    except Exception:
        return False


def _rational_value(expr):
    """The value of ``expr`` if it is arithmetic on numbers whose result is a (finite) rational or decimal number,
    else ``None`` (an unknown, a constant, an irrational root; a power too large to compute is left unread)."""
    import sympy

    if isinstance(expr, sympy.Number):
        return expr
    if not isinstance(expr, (sympy.Add, sympy.Mul, sympy.Pow)):
        return None
    values = [_rational_value(arg) for arg in expr.args]
    if any(value is None for value in values):
        return None
    if isinstance(expr, sympy.Pow):
        base, exponent = values
        digits = abs(exponent) * math.log10(max(abs(base.p), abs(base.q), 2)) if base.is_Rational else 0
        if digits > 10_000:
            return None
    value = expr.func(*values)
    return value if isinstance(value, sympy.Number) and value.is_finite else None


def _written_rational(expr) -> bool:
    """A rational number as an answer writes it (``expr`` is one, :func:`_rational_value`): a literal, a sign, a
    reciprocal of an integer, an integer over an integer in lowest terms, a power of ten alone or times a number."""
    import sympy

    if isinstance(expr, sympy.Number) or _ten_power(expr):
        return True
    if isinstance(expr, sympy.Pow):
        return expr.exp == -1 and expr.base.is_Integer
    if not isinstance(expr, sympy.Mul):
        return False
    factors = [f for f in _flattened(expr, sympy.Mul) if f not in (1, -1)]
    tens = [f for f in factors if _ten_power(f)]
    rest = [f for f in factors if not _ten_power(f)]
    if not factors:
        return True  # a sign: the -1 and 1 of -\frac{1}{x}, parsed -1 \cdot 1 \cdot x^{-1}
    if tens:
        return len(tens) == 1 and len(rest) <= 1 and all(isinstance(f, sympy.Number) for f in rest)
    if len(rest) == 1:
        return _written_rational(rest[0])
    integers = [f for f in rest if f.is_Integer]
    reciprocals = [f for f in rest if isinstance(f, sympy.Pow) and f.exp == -1 and f.base.is_Integer]
    return (len(rest) == 2 and len(integers) == 1 and len(reciprocals) == 1
            and math.gcd(int(integers[0]), int(reciprocals[0].base)) == 1)


def _ten_power(expr) -> bool:
    """``10^{k}`` or ``\\frac{1}{10^{k}}`` for an integer k."""
    import sympy

    if isinstance(expr, sympy.Pow) and expr.exp == -1:
        expr = expr.base
    return isinstance(expr, sympy.Pow) and expr.base == 10 and expr.exp.is_Integer


def _value(expr):
    """What math-verify compares a non-equation gold answer with: the right side of an equation (``x = 5`` -> 5)."""
    from math_verify.grader import is_equation, take_last_relation

    return take_last_relation(expr).rhs if is_equation(expr) else expr


def _free_symbols(expr) -> set:
    try:
        return set(expr.free_symbols)
    except Exception:
        return set()


def _percent_value(expr):
    """``X`` for a percentage ``X\\%`` (math-verify's ``X * UnevaluatedExpr(1/100)``), else ``None``."""
    from math_verify.grader import get_pct_val

    return get_pct_val(expr)


def _plain_number(expr) -> bool:
    """A gold answer that is a number: an integer, a fraction, a decimal, or a percentage of one."""
    import sympy

    percent = _percent_value(expr)
    return isinstance(percent if percent is not None else expr, sympy.Number)


def _numeric_gold(expr) -> bool:
    """A gold answer that needs a written number: plain numbers (:func:`_plain_numbers`) or one written number with
    a constant or root (``9801\\pi``, ``144\\sqrt{3}``), where ``99^2 \\pi`` is arithmetic left to do."""
    return _plain_numbers(expr) or (not _free_symbols(expr) and _elements(expr) is None and _written_number(expr))


def _plain_numbers(expr) -> bool:
    """A gold answer that is a number (:func:`_plain_number`), or a set, tuple or matrix of numbers (``3, 5, 7``)."""
    elements = _elements(expr)
    if elements is not None:
        return bool(elements) and all(_plain_number(element) for element in elements)
    return _plain_number(expr)


def _elements(expr) -> list | None:
    """The elements of a set or a tuple, the entries of a matrix, or the ends of an interval (or of a union's
    intervals and sets: math-verify reads a pair ``(2, 5)`` as an open interval); ``None`` for anything else."""
    import sympy

    if isinstance(expr, sympy.MatrixBase):
        return list(expr)
    if isinstance(expr, sympy.Interval):
        return [expr.start, expr.end]
    if isinstance(expr, sympy.Union):
        parts = [_elements(arg) for arg in expr.args]
        return None if any(part is None for part in parts) else [end for part in parts for end in part]
    return list(expr.args) if isinstance(expr, (sympy.FiniteSet, sympy.Tuple)) else None


def _written_number(expr) -> bool:
    """A number written as a final answer: a literal (``-5``, ``\\frac{1}{2}``, ``0.15``), a percentage, scientific
    notation (``1.2 \\times 10^{6}``), an irrational root of a literal, ``\\pi``, ``e``, ``i`` -- not arithmetic still
    to do; or a set, tuple, interval or matrix of them."""
    import sympy

    percent = _percent_value(expr)
    if percent is not None:
        return _written_number(percent)
    if isinstance(expr, (sympy.Number, sympy.NumberSymbol)) or expr is sympy.I:
        return True
    if isinstance(expr, sympy.exp):
        return _written_number(expr.exp)  # a power of e, e^{-1} or \sqrt{e} (sympy's exp(-1) and E^{1/2} alike)
    elements = _elements(expr)
    if elements is not None:
        return all(_written_number(element) for element in elements)  # \{18\} for 18, a vector of numbers
    if isinstance(expr, sympy.Pow):
        base, exponent = expr.args
        if isinstance(base, (sympy.Pow, sympy.exp)):  # a power of a power: \frac{1}{\sqrt{2}}, not \sqrt{e^2}
            root = exponent.is_Rational and exponent.p == 1 and base.exp.is_Integer and 0 < base.exp < exponent.q
            if root and math.gcd(int(base.exp), exponent.q) == 1:
                return _written_number(base)  # a root with nothing to take out: \sqrt[3]{e^2}
            return exponent == -1 and base.exp.is_positive and _written_number(base)
        if base == 10 and exponent.is_Integer:
            return True  # 10^{-3}
        if isinstance(base, sympy.NumberSymbol) and exponent.is_Integer:
            return True  # \pi^2
        if exponent == -1 and isinstance(base, sympy.Float):
            return False  # a division by a decimal left to do: \frac{1}{0.025} for 40
        if exponent.is_Rational and not exponent.is_Integer and sympy.Pow(base, exponent).is_Rational:
            return False  # a root left to take: \sqrt{9801} for 99
        if exponent == -1 or (exponent.is_Rational and not exponent.is_Integer):
            return _written_number(base)  # a reciprocal (\frac{1}{\sqrt{2}}) or a root (\sqrt{2})
        return False
    if isinstance(expr, sympy.Mul):
        numbers = [f for f in expr.args if isinstance(f, sympy.Number) and abs(f) != 1]
        powers = []
        for factor in _flattened(expr, sympy.Mul):
            base, exponent = _base_and_exponent(factor)
            inner = _flattened(base, sympy.Mul) if base.is_Mul else [base]  # the 2 and the e of \frac{1}{2e}
            powers += [(b, (e * exponent).is_Integer) for b, e in map(_base_and_exponent, inner) if not b.is_Number]
        # two whole powers or two roots of one constant: e \cdot e, \frac{e^3}{e^2}, \frac{e^{3/2}}{e^{1/2}}
        if len(powers) != len(set(powers)):
            return False  # (a whole power times a root is written: \pi\sqrt{\pi})
        return len(numbers) <= 1 and all(_written_number(f) for f in expr.args)
    return False


def _base_and_exponent(factor) -> tuple:
    """A factor's base and exponent through nested powers: ``\\frac{1}{e^2}`` is (e, -2), ``\\sqrt{\\pi}`` is
    (\\pi, 1/2)."""
    base, exponent = factor.as_base_exp()
    while base.as_base_exp()[0] != base:
        base, power = base.as_base_exp()
        exponent = exponent * power
    return base, exponent


def _less_simplified(value, gold) -> bool:
    """More than one operation longer than the gold answer. Not judged for text answers (read as symbols) or for
    answers with functions (``\\cot x`` written ``\\frac{\\cos x}{\\sin x}``, ``\\log_2 3`` as a quotient of logs)."""
    import sympy

    if isinstance(gold, sympy.Symbol) or _has_function(gold) or _has_function(value):
        return False
    gold_size, size = _operation_count(gold), _operation_count(value)
    return gold_size is not None and size is not None and size > gold_size + 1 and not _one_fraction(value, gold)


def _one_fraction(value, gold) -> bool:
    """One fraction with no like terms left to collect, no longer than sympy's single fraction for the gold answer
    (``\\frac{x + 2}{2x}`` for ``\\frac{1}{x} + \\frac{1}{2}``): the gold answer simplified another way."""
    import sympy

    def like_terms(node) -> bool:  # x + 1 + x, 1 + 2
        terms = [term.as_coeff_Mul()[1] for term in _flattened(node, sympy.Add)]
        return len(terms) != len(set(terms))

    try:
        return (_fraction_parts(value) is not None
                and not any(like_terms(node) for node in sympy.preorder_traversal(value) if node.is_Add)
                and _operation_count(value) <= _operation_count(sympy.cancel(gold)))
    except Exception:
        return False


def _has_function(expr) -> bool:
    import sympy

    try:
        return bool(expr.atoms(sympy.Function))
    except Exception:
        return True


def _operation_count(expr) -> int | None:
    """Operations written in an answer: each sum, product, power, function, relation. Numbers (``-\\frac{3}{4}``,
    ``0.5``; arithmetic on numbers is judged by its result, :func:`_arithmetic_left`), a sign, a numeric coefficient
    (``\\frac{4 \\pi r^3}{3}`` counts as ``\\frac{4}{3} \\pi r^3``), a percent sign and the brackets of a set, tuple or
    interval are free. ``None``: not counted (e.g. a matrix of symbols)."""
    import sympy

    percent = _percent_value(expr)
    if percent is not None:
        return _operation_count(percent)
    if _rational_value(expr) is not None:
        return 0  # arithmetic on numbers is judged by its result (_arithmetic_left): 2^{-10} for \frac{1}{2^{10}}
    if isinstance(expr, sympy.MatrixBase):
        counts = [_operation_count(entry) for entry in expr]
        return None if None in counts else sum(counts)
    if not isinstance(expr, sympy.Basic):
        return None
    if not expr.args or isinstance(expr, (sympy.Number, sympy.Symbol, sympy.NumberSymbol)):
        return 0
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        parts = _flattened(expr, type(expr))
        if expr.is_Mul:  # numbers and their reciprocals make one coefficient, a sign none
            coefficient = [sympy.Integer(2)] if any(_is_numeral(p) and p not in (1, -1) for p in parts) else []
            parts = [p for p in parts if not _is_numeral(p)] + coefficient
        counts = [_operation_count(part) for part in parts]
        return None if None in counts else max(len(counts) - 1, 0) + sum(counts)
    counts = [_operation_count(arg) for arg in expr.args]
    if None in counts:
        return None
    if isinstance(expr, (sympy.FiniteSet, sympy.Tuple, sympy.Interval, sympy.UnevaluatedExpr)):
        return sum(counts)
    return 1 + sum(counts)


def _flattened(expr, kind) -> list:
    """The terms of nested sums, or the factors of nested products, as written (they are not evaluated)."""
    return [part for arg in expr.args for part in (_flattened(arg, kind) if isinstance(arg, kind) else [arg])]


def _is_numeral(expr) -> bool:
    """A number, the reciprocal of one (``\\frac{x}{3}`` is parsed as ``x \\cdot 3^{-1}``) or a power of ten (or its
    reciprocal: ``\\frac{1}{10^3}``)."""
    import sympy

    return isinstance(expr, sympy.Number) or _ten_power(expr) or (
        isinstance(expr, sympy.Pow) and isinstance(expr.base, sympy.Number) and expr.exp == -1)


def _too_far(value, gold) -> bool:
    """A small gold number (under 10^{-3}: the gold answer, or an element of a set, tuple, interval or matrix) that
    no number of the answer is within 0.1 % of: math-verify's own test, ``(gold - answer).evalf(chop=True) == 0``,
    passes any two numbers under about 10^{-15} (``5 \\times 10^{-19}`` for ``1.6 \\times 10^{-19}``, also as
    ``\\{5 \\times 10^{-19}\\}`` or in a tuple). An answer without numbers is left to math-verify."""
    import sympy

    try:
        small = [g for g in (complex(sympy.N(n.doit(), 20)) for n in _numbers(gold)) if 0 < abs(g) < 1e-3]
        answer = [complex(sympy.N(n.doit(), 20)) for n in _numbers(value)] if small else []
        return bool(answer) and any(all(abs(a - g) > 1e-3 * abs(g) for a in answer) for g in small)
    except Exception:
        return False


def _float_rounding(gold_parsed: list) -> int:
    """math-verify rounds decimals to 6 places (0.0000001 "equals" 10^{-8}); for a gold answer under 10^{-3}
    (or an element of one: a set, a tuple, an interval, a matrix) keep about 4 significant digits instead."""
    import sympy

    sizes = []
    for gold in gold_parsed:
        for number in _numbers(_value(gold)) if isinstance(gold, sympy.Basic) else ():
            try:
                sizes.append(abs(complex(sympy.N(number.doit(), 20))))
            except Exception:
                continue
    smallest = min((size for size in sizes if size > 0), default=math.inf)
    if not smallest < 1e-3:
        return 6
    return min(max(6, 3 - math.floor(math.log10(smallest))), 100)


def _numbers(expr) -> list:
    """The numbers an answer is made of: itself, or the elements of a set, tuple, interval or matrix."""
    import sympy

    if isinstance(expr, (sympy.FiniteSet, sympy.Tuple, sympy.Union)):
        return [number for arg in expr.args for number in _numbers(arg)]
    if isinstance(expr, sympy.Interval):
        return _numbers(expr.start) + _numbers(expr.end)
    if isinstance(expr, sympy.MatrixBase):
        return [number for entry in expr for number in _numbers(entry)]
    percent = _percent_value(expr)
    if percent is not None:
        return [number / 100 for number in _numbers(percent)]
    return [expr] if isinstance(expr, sympy.Expr) and expr.is_number else []


def _check(source: str, gold: str, parsing_timeout: int, verify_timeout: int, answer_rules: bool = True) -> bool:
    """One check in the child: ``gold`` is the bare gold answer."""
    from math_verify.errors import TimeoutException

    try:
        gold_parsed = parse_boxed(as_boxed(gold), parsing_timeout)
    except (Exception, TimeoutException):
        return False
    return bool(gold_parsed) and verify_source(source, gold_parsed, parsing_timeout, verify_timeout, gold,
                                               answer_rules)


def _serve() -> None:
    """Child loop: one JSON ``[prediction source, bare gold]`` per input line, ``1`` / ``0`` per output line."""
    parsing_timeout, verify_timeout, answer_rules = int(sys.argv[-3]), int(sys.argv[-2]), sys.argv[-1] == "1"
    _check(as_boxed("1"), "1", parsing_timeout, verify_timeout)  # imports off the first check's clock
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        out.write(b"1\n" if _check(*json.loads(line), parsing_timeout, verify_timeout, answer_rules) else b"0\n")
        out.flush()


def boot_command(parsing_timeout: int, verify_timeout: int, answer_rules: bool = True) -> list[str]:
    """The child's command line (this file loaded by path, so the ``trl_diffusion`` package is not imported; it
    ends when its parent does)."""
    from .dllm_rl_math import boot_source  # parent side only: the child never calls this

    settings = [str(int(parsing_timeout)), str(int(verify_timeout)), "1" if answer_rules else "0"]
    return [sys.executable, "-c", boot_source("_math_verify_check_child"), os.path.abspath(__file__), *settings]


if __name__ == "__main__":
    _serve()
