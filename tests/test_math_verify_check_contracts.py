"""Contracts of ``trl_diffusion/rewards/math_verify_check.py`` (the math reward's rules on top of math-verify) and of
``trl_diffusion/zero3.py`` that the red-team tests leave open: each rule's boundary (an answer just past it is
refused, one just inside it still scores), the operations not covered there, and ZeRO-3's gathering helpers with a
stand-in for DeepSpeed."""

import contextlib
import sys
import types

import pytest
import torch
from torch import nn

from trl_diffusion import zero3
from trl_diffusion.rewards.math_reward import MathAccuracyReward
from trl_diffusion.rewards.math_verify_check import as_boxed, parse_boxed, verify_source

REWARD = MathAccuracyReward(parsing_timeout=2, verify_timeout=2)
PLAIN = MathAccuracyReward(parsing_timeout=2, verify_timeout=2, answer_rules=False)


def boxed(answer):
    return f"So the answer is $\\boxed{{{answer}}}$."


def scores(pairs, reward=REWARD):
    """The reward of each (answer in the box, gold) pair, in one call."""
    return reward([boxed(answer) for answer, _ in pairs], answer=[gold for _, gold in pairs])


def check(answer, gold, answer_rules=True):
    """``verify_source`` called directly, as the reward calls it for a boxed answer."""
    gold_parsed = parse_boxed(as_boxed(gold), 2)
    return verify_source(as_boxed(answer), gold_parsed, 2, 2, gold, answer_rules)


# ------------------------------------------------------------------------------------ operations left to sympy

OPERATIONS = {
    "gcd": (r"\gcd(12, 18)", "6"),
    "gcd in an expression": (r"x + \gcd(12, 18)", "x + 6"),  # evaluated while parsing: only its LaTeX shows it
    "lcm": (r"\operatorname{lcm}(4, 6)", "12"),
    "derivative": (r"\frac{d}{dx} x^2", "2x"),
    "limit": (r"\lim_{n \to \infty} \frac{n+1}{n}", "1"),
    "choose": (r"{31 \choose 28}", "4495"),
    "product": (r"\prod_{k=1}^{3} k", "6"),
    "determinant": (r"\det \begin{pmatrix} 7 & 3 \\ -1 & 2 \end{pmatrix}", "17"),
    "minimum": (r"\min(3, 7)", "3"),
    "gamma": (r"\Gamma(6)", "120"),
    "modulo": (r"20 \mod 7", "6"),
    "floor": (r"\lfloor 7.5 \rfloor", "7"),
    "hyperbolic sine": (r"\sinh(0)", "0"),
    "vert bars": (r"\lvert -7 \rvert", "7"),
}


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_an_operation_the_gold_does_not_use_is_refused(name):
    """The question's expression copied into the box is no answer, for every operation sympy would evaluate."""
    answer, gold = OPERATIONS[name]
    assert check(answer, gold, answer_rules=False)  # math-verify alone accepts it
    assert not check(answer, gold)


# --------------------------------------------------------------------------------------- each rule's boundary

# (answer in the box, gold): math-verify alone scores each 1.0; the rules must refuse it.
REFUSED = {
    # an improper fraction of equal parts after an integer is a mixed number no reader writes: 17 + 1
    "an improper mixed number of equal parts": (r"17 \frac{5}{5}", "18"),
    "an improper mixed number of equal parts with a slash": ("17 (5/5)", "18"),
    # a gold assignment is compared by its value: the value's rules hold
    "arithmetic for an assigned number": ("99^2", "x = 9801"),
    "an unknown that cancels for an assigned number": (r"\frac{18y}{y}", "x = 18"),
    "arithmetic for a percentage": (r"5 \cdot 5\%", r"25\%"),
    "a product of two numbers": (r"6 \times 7", "42"),
    "two operations more than the gold": (r"x \cdot x \cdot x \cdot x", "x^4"),
    "two operations of numbers more than the gold": ("x + 5 - 2 - 2", "x + 1"),
    "a small number off by 0.6 %": (r"1.61 \times 10^{-19}", r"1.6 \times 10^{-19}"),
    "a small number in a set off in its fourth digit": ("0.00000001002, 1", "10^{-8}, 1"),
    "a small number in an interval off in its fourth digit": ("[0.00000001002, 1]", "[10^{-8}, 1]"),
    "a small percentage off in its fourth digit": ("0.0005004", r"0.05\%"),
    "a small assigned number off in its fourth digit": ("0.000000010009", "x = 10^{-8}"),
    # integers side by side after a closing bracket, no space: latex2sympy's mixed number 17 + 25
    "juxtaposed after a closing brace": ("{17}25", "42"),
    "juxtaposed after a closing parenthesis": ("(17)25", "42"),
    "an operation after an equivalence": (r"x \equiv 99^2", "9801"),
    "a modulo in an expression": (r"x + 20 \mod 7", "x + 6"),
    # an unknown that cancels where the gold has none, past the rules that do not judge functions
    "an unknown that cancels in a logarithm": (r"\log_2 \frac{3x}{x}", r"\log_2 3"),
    "an unknown added and removed beside a power of e": ("e^{2} + x - x", "e^{2}"),
    # an assignment for an assigned gold is judged by its right side, as against the bare gold
    "an unsimplified equation": ("y = 2x + 5 - 1 - 1", "y = 2x + 3"),
    "unsimplified assignments": ("x = 5 - 1 - 1, y = 4", "x = 3, y = 4"),
    "arithmetic assigned for an assigned number": ("x = 99^2", "x = 9801"),
    "a difference assigned for an assigned number": ("x = 50 - 8", "x = 42"),
    "arithmetic in assignments for assigned numbers": ("x = 99^2, y = 1", "x = 9801, y = 1"),
    "an assignment of arithmetic in braces for an assigned number": (r"\{x = 99^2\}", "x = 9801"),
    "arithmetic assigned for an assignment in braces": ("x = 99^2", r"\{x = 9801\}"),
    "a far small number assigned for an assigned one": (r"x = 5 \times 10^{-19}", r"x = 1.6 \times 10^{-19}"),
    # a small number far from the gold is refused inside a container too
    "a far small number in braces": (r"\{5 \times 10^{-19}\}", r"1.6 \times 10^{-19}"),
    "a far small number in a set": (r"5 \times 10^{-19}, 1", r"1.6 \times 10^{-19}, 1"),
    "a far small number in a tuple": (r"(5 \times 10^{-19}, 1)", r"(1.6 \times 10^{-19}, 1)"),
    "a far small number in a matrix": (
        r"\begin{pmatrix} 5 \times 10^{-19} \end{pmatrix}",
        r"\begin{pmatrix} 1.6 \times 10^{-19} \end{pmatrix}",
    ),
    "a division by a decimal left to do": (r"\frac{1}{0.025}", "40"),
    # math-verify reads a pair (a, b) with a < b as an open interval: its ends must be written numbers too
    "arithmetic in a pair read as an interval": ("(99^2, 10000)", "(9801, 10000)"),
    "arithmetic at an interval's end": (r"[99^2, \infty)", r"[9801, \infty)"),
    "arithmetic in a union of intervals": (r"(-\infty, 0) \cup [50 - 8, \infty)", r"(-\infty, 0) \cup [42, \infty)"),
    "a set of arithmetic for a pair": (r"\{1, 99^2\}", "(1, 9801)"),
    # an assignment written the other way round is an assignment
    "arithmetic assigned the other way round": ("99^2 = x", "x = 9801"),
    "assignments the other way round": ("1 = y, 99^2 = x", "x = 9801, y = 1"),
    "a far small number assigned the other way round": (r"5 \times 10^{-19} = x", r"x = 1.6 \times 10^{-19}"),
    "an operation assigned the other way round": (r"\binom{4}{2} = x", "x = 6"),
    # a base subscript after LaTeX spacing, which math-verify drops as it drops the subscript
    "a base after a thin space": (r"52\,_9", "52_8"),
    "a base after a quad": (r"52\quad_9", "52_8"),
    "lowercase gamma, evaluated as the factorial": (r"\gamma(5)", "24"),
    "a root left to take": (r"\sqrt{9801}", "99"),
    "a cube root left to take": ("8^{1/3}", "2"),
    # a division of integers latex2sympy does while parsing: only the text shows it
    "a division with a slash": ("1234/2", "617"),
    "a division with div": (r"1234 \div 2", "617"),
    "a fraction that is a whole number": (r"\frac{39204}{4}", "9801"),
    "a fraction not in lowest terms": (r"\frac{6}{4}", r"\frac{3}{2}"),
    # a gold that is one written number with a constant or a root needs a written number too
    "arithmetic times pi": (r"99^2 \pi", r"9801\pi"),
    "a product of numbers times pi": (r"2 \cdot 3 \cdot 5 \cdot 7 \cdot 11 \pi", r"2310\pi"),
    "an area formula left to evaluate": (r"\pi \cdot 5^2", r"25\pi"),
    "arithmetic times a root": (r"12^2 \sqrt{3}", r"144\sqrt3"),
    # arithmetic on numbers inside an expression, a relation or a container that the gold does not leave
    "a power of numbers in a sum": ("99^2 + i", "9801 + i"),
    "a power of numbers in a relation": (r"x \le 99^2", r"x \le 9801"),
    "a power of numbers as a coefficient": ("99^2 x", "9801x"),
    "a power of numbers in an equation": ("y = 99^2 x", "y = 9801x"),
    "a product of numbers in a sum": (r"2 \cdot 3 + i", "6 + i"),
    "a product of numbers in a relation": (r"x > 2 \cdot 3", "x > 6"),
    "a sum of numbers as a coefficient": ("(3 + 4)x", "7x"),
    "two numbers added beside a root": (r"3 + 4 + \sqrt{2}", r"7 + \sqrt{2}"),
    "a number times a fraction": (r"2 \frac{10x}{3}", r"\frac{20x}{3}"),
    "a product of numbers in a matrix entry": (r"\begin{pmatrix} 2 \cdot 3 \\ x \end{pmatrix}",
                                               r"\begin{pmatrix} 6 \\ x \end{pmatrix}"),
    "a power for the gold's number in an expression": ("2^{10} x", "1024 x"),
    "a nested fraction": (r"\frac{4}{\frac{1}{10}}", "40"),
    "a reciprocal of a fraction": (r"\frac{1}{\frac{1}{40}}", "40"),
    "a product of powers of ten": (r"10^{2} \cdot 10^{3}", "100000"),
    "a product of numbers in scientific notation": (r"2 \cdot 3 \times 10^{5} x", r"6 \times 10^{5} x"),
    "a fraction not in lowest terms beside a root": (r"\frac{6\sqrt{2}}{8}", r"\frac{3\sqrt{2}}{4}"),
    "a fraction not in lowest terms with an unknown": (r"\frac{39204}{4} x", "9801x"),
    "a ratio not in lowest terms": ("1234 : 2", "617"),
    # the same division in every way LaTeX writes a fraction of integers
    "a fraction with over": (r"{1234 \over 2}", "617"),
    "a cfrac": (r"\cfrac{1234}{2}", "617"),
    "a fraction with an unbraced denominator": (r"\frac{1234}2", "617"),
    "a fraction of doubly braced integers": (r"\frac{{1234}}{{2}}", "617"),
    "a fraction of parenthesised integers": (r"\frac{(1234)}{(2)}", "617"),
    "a slash before a parenthesised integer": ("1234 / (2)", "617"),
    "a slash after a sized parenthesis": (r"\left(1234\right)/2", "617"),
    "a fraction over one with an unknown": (r"\frac{617}{1} x", "617x"),
    # ... with a signed part (latex2sympy divides signed integers while parsing too)
    "a negative numerator": (r"\frac{-6}{4}", r"-\frac{3}{2}"),
    "a negative denominator": (r"\frac{1234}{-2}", "-617"),
    "two negative parts": (r"\frac{-1234}{-2}", "617"),
    "a plus-signed numerator": (r"\frac{+1234}{2}", "617"),
    "a negative integer over one": (r"\frac{-1234}{1}", "-1234"),
    "an integer over minus one": (r"\frac{1234}{-1}", "-1234"),
    "a spaced negative integer in parentheses": (r"\frac{( - 6 )}{4}", r"-\frac{3}{2}"),
    "a slash before a negative integer": ("6/-4", r"-\frac{3}{2}"),
    "a parenthesised negative integer over another": ("(-6)/4", r"-\frac{3}{2}"),
    "a ratio to a negative integer": ("1234 : -2", "-617"),
    "a signed fraction in an equation": (r"y = \frac{-6}{4}x + 1", r"y = -\frac{3}{2}x + 1"),
    # ... with spacing or characters math-verify deletes before parsing
    "thin spaces inside a fraction": (r"\dfrac{\,1234\,}{2}", "617"),
    "a negative thin space in a fraction": (r"\frac{1234\!}{2}", "617"),
    "displaystyle in a fraction": (r"\frac{\displaystyle 1234}{2}", "617"),
    "a quad in a fraction": (r"\frac{1234\quad}{2}", "617"),
    "thin spaces around a slash": (r"1234\,/\,2", "617"),
    "thin spaces around a ratio": (r"1234\,:\,2", "617"),
    "thin spaces around over": (r"1234 \,\over\, 2", "617"),
    "a prime in a fraction": (r"\frac{1234'}{2}", "617"),
    "a dollar sign in a fraction": (r"\frac{\$1234}{2}", "617"),
    "an empty text before a slash": (r"1234\text{}/2", "617"),
    "a spaced fraction with an unknown": (r"\frac{1234\,}{2}x", "617x"),
    "a spaced fraction in a matrix": (r"\begin{pmatrix} \frac{1234\,}{2} \\ 3 \end{pmatrix}",
                                      r"\begin{pmatrix} 617 \\ 3 \end{pmatrix}"),
    "a spaced fraction under a root": (r"\sqrt{\frac{1234\,}{2}}", r"\sqrt{617}"),
    "the division sign": ("1234 \u00f7 2", "617"),
    # latex2sympy's mixed number where a reader multiplies, or behind a deleted character
    "a parenthesised integer before a fraction": (r"(600)\frac{35}{2}", r"\frac{1235}{2}"),
    "a braced integer before a fraction": (r"{600}\frac{35}{2}", r"\frac{1235}{2}"),
    "a mixed number with signed parts": (r"600\frac{-35}{-2}", r"\frac{1235}{2}"),
    "integers apart by a prime": ("600 '17", "617"),
    "integers apart by a dollar sign": (r"600 \$17", "617"),
    "parenthesised integers apart by a prime": ("(600)'(17)", "617"),
    "a union the parse evaluates": (r"\{1,2\} \cup \{3\}", r"\{1,2,3\}"),
    "a union of touching intervals": (r"[1,2] \cup [2,3]", "[1,3]"),
    # a power of a product, a radical not simplified, a fraction to reduce, a product to expand
    "a power of a product with a number": ("(3x)^2", "9x^2"),
    "a cube of a product with a number": ("(2x^2)^3", "8x^6"),
    "a power of a quotient by a number": (r"\left(\frac{x}{2}\right)^2", r"\frac{x^2}{4}"),
    "a reciprocal of a power of a product": (r"\frac{1}{(2x)^2}", r"\frac{1}{4x^2}"),
    "a square root with a square factor": (r"\sqrt{8}", r"2\sqrt{2}"),
    "a large radical to simplify": (r"\sqrt{29403}", r"99\sqrt{3}"),
    "a radical to simplify times a number": (r"2\sqrt{12}", r"4\sqrt{3}"),
    "a cube root with a cube factor": (r"\sqrt[3]{54}", r"3\sqrt[3]{2}"),
    "a product of radicals": (r"\sqrt{2}\sqrt{6}", r"2\sqrt{3}"),
    "a radical to simplify over a number": (r"\frac{\sqrt{12}}{2}", r"\sqrt{3}"),
    "a quadratic formula's fraction to reduce": (r"\frac{2+2\sqrt{5}}{4}", r"\frac{1+\sqrt{5}}{2}"),
    "a fraction of a sum to reduce": (r"\frac{4x+6}{2}", "2x+3"),
    "a fraction of a sum sharing a factor": (r"\frac{2x+4}{6}", r"\frac{x+2}{3}"),
    "half of a sum to reduce": (r"\frac{1}{2}(4x+6)", "2x+3"),
    "a square to expand": ("(x+3)^2", "x^2+6x+9"),
    "a product to expand": ("(2x+1)(x-3)", "2x^2-5x-3"),
    "a difference of squares to expand": ("(x+99)(x-99)", "x^2-9801"),
    "a root of a fraction to simplify": (r"\sqrt{\frac{48}{25}}", r"\frac{4\sqrt{3}}{5}"),
    "a root of a fraction with a square denominator": (r"\sqrt{\frac{3}{4}}", r"\frac{\sqrt{3}}{2}"),
    "a root of a number times an unknown to simplify": (r"\sqrt{48x}", r"4\sqrt{3x}"),
    "a root of a square times an unknown": (r"\sqrt{4x}", r"2\sqrt{x}"),
    "a power of a power of an unknown": ("(x^2)^3", "x^6"),
    "a power of a product of unknowns": ("(ab)^3", "a^3b^3"),
    "a power of a product with a power": ("(a^2b)^3", "a^6b^3"),
    "a power of a power of a constant": (r"(\pi^2)^2", r"\pi^4"),
    "a monomial times a sum to expand": ("x(x+3)", "x^2+3x"),
    "a product of unknowns times a sum to expand": ("a(b+c)", "ab+ac"),
    # the expansion for a factored gold answer: the "factor" question copied
    "a difference of squares for its factors": ("x^2-9", "(x-3)(x+3)"),
    "a quadratic for its factors": ("6x^2-x-2", "(2x+1)(3x-2)"),
    "a quadratic for its completed square": ("x^2+6x+7", "(x+3)^2-2"),
    "a quadratic for a monomial times a sum": ("x^2+3x", "x(x+3)"),
    "a polynomial for its common factor": ("6x^2+15x", "3x(2x+5)"),
    # a fraction hidden behind a mark math-verify drops: a base-10 subscript, a degree sign, the division slash
    "the division slash": ("1234\u22152", "617"),
    "a base-10 subscript in a fraction": (r"\frac{1234_{10}}{2}", "617"),
    "a bracketed base-10 subscript in a fraction": (r"\frac{1234_{(10)}}{2}", "617"),
    "a degree sign on a numerator": (r"\frac{1234^\circ}{2}", "617"),
    "a degree sign on a denominator": (r"\frac{1234}{2^\circ}", "617"),
    "a base-10 subscript before a ratio": ("1234_{10}:2", "617"),
    "a base-10 subscript between juxtaposed integers": ("17_{10} 25", "42"),
    "a degree sign in a mixed number's fraction": (r"17\frac{25^\circ}{1}", "42"),
    "a numeric square to expand": (r"(1+\sqrt{2})^2", r"3+2\sqrt{2}"),
    "a product of conjugates to expand": (r"(1+\sqrt{2})(1-\sqrt{2})", "-1"),
    "a square of a negated unknown": ("(-x)^2", "x^2"),
    "a negative power of a radical to simplify": ("48^{-1/2}", r"\frac{\sqrt{3}}{12}"),
    "a radical of a 31-digit integer to simplify": (r"\sqrt{8" + "0" * 30 + "}", r"2 \times 10^{15} \sqrt{2}"),
    "a ratio over one": ("617 : 1", "617"),
    "a decimal power left to take": ("4^{0.5} x", "2x"),
    "arithmetic in a power of e": ("e^{2-1}", "e"),
    "a power of e of a logarithm": (r"e^{\ln 2}", "2"),
    "a zero added to a power of e": ("e^{-1}+0", r"\frac{1}{e}"),
    "a sum to collect in a power of e": (r"e^{\sqrt{2}+\sqrt{2}}", r"e^{2\sqrt{2}}"),
    "powers of e to combine": ("e^{2}e^{3}", "e^{5}"),
    "a product of e with itself": (r"e \cdot e", "e^2"),
    "a quotient of powers of e": (r"\frac{e^2}{e}", "e"),
    # one fraction for a gold sum of fractions, but not in lowest terms or with like terms to collect
    "one fraction not in lowest terms for a sum": (r"\frac{2x+4}{4x}", r"\frac{1}{x}+\frac{1}{2}"),
    "one fraction with like terms for a sum": (r"\frac{x+1+x}{x^2+x}", r"\frac{1}{x}+\frac{1}{x+1}"),
    "one fraction with a zero added for a sum": (r"\frac{2x+1}{x^2+x+0}", r"\frac{1}{x}+\frac{1}{x+1}"),
    "one fraction for a sum of fractions, not reduced": (r"\frac{x^2+2x}{2x^2}", r"\frac{1}{x}+\frac{1}{2}"),
    "a product of fractions for a sum": (r"\frac{x+2}{2} \cdot \frac{1}{x}", r"\frac{1}{x}+\frac{1}{2}"),
    # a second pass: sums in denominators, nested powers of a constant, a term of a relation
    "a denominator sum sharing a factor with the numerator": (r"\frac{6}{3x+6}", r"\frac{2}{x+2}"),
    "a numerator sum sharing a factor with the denominator": (r"\frac{2x+2}{4x}", r"\frac{x+1}{2x}"),
    "a sum over a number times a sum": (r"\frac{4x+6}{2(x+1)}", r"\frac{2x+3}{x+1}"),
    "a negated denominator sum to reduce": (r"\frac{6}{-3x-6}", r"-\frac{2}{x+2}"),
    "a quotient of whole powers of e": (r"\frac{e^{3}}{e^{2}}", "e"),
    "a reciprocal of a negative power of e": (r"\frac{1}{e^{-1}}", "e"),
    "a root of a power of e": (r"\sqrt{e^{2}}", "e"),
    "a product of pi with itself": (r"\pi \cdot \pi", r"\pi^{2}"),
    "a root of a power of pi": (r"\sqrt{\pi^{4}}", r"\pi^{2}"),
    "a number times a polynomial in an inequality": (r"x \le 3(y+2)", r"x \le 3y+6"),
    # a third pass: roots of e combined, divisions left to do, complex fractions, a number times a sum in disguise
    "two roots of e to combine": (r"e^{1/2}e^{1/2}", "e"),
    "a quotient of roots of e": (r"5\cdot\frac{e^{1/3}}{e^{1/3}}", "5"),
    "a root of a power of e with something to take out": (r"\sqrt{e^{3}}", "e^{3/2}"),
    "a polynomial division left to do": (r"\frac{x^4-1}{x-1}", "x^3+x^2+x+1"),
    "a power of a sum over the sum": (r"\frac{(x+1)^4}{x+1}", "(x+1)^3"),
    "a power of a sum over a number it shares": (r"\frac{(3x+3)^2}{9}", "(x+1)^2"),
    "a difference of cubes over its factor": (r"\frac{a^3-b^3}{a-b}", "a^2+ab+b^2"),
    "a complex fraction of unknowns": (r"\frac{1}{\frac1x+\frac1y}", r"\frac{xy}{x+y}"),
    "a fraction of a number in a denominator": (r"\frac{\frac32}{\frac x2+1}", r"\frac{3}{x+2}"),
    "a number times a sum over one": (r"\frac{3(x+2)}{1}", "3x+6"),
    "a number times a sum to the first power": ("3(x+2)^{1}", "3x+6"),
    "a whole decimal times a sum": ("3.0(x+2)", "3x+6"),
    # a fourth pass: the same rules inside a matrix, roots of a number times an unknown, a root's index to reduce
    "a root in a denominator inside a matrix": (r"\begin{pmatrix} \frac{6}{\sqrt{3}} \\ 1 \end{pmatrix}",
                                                 r"\begin{pmatrix} 2\sqrt{3} \\ 1 \end{pmatrix}"),
    "a complex fraction inside a matrix": (r"\begin{pmatrix} x \\ \frac{x}{1+\frac{1}{x}} \end{pmatrix}",
                                           r"\begin{pmatrix} x \\ \frac{x^2}{x+1} \end{pmatrix}"),
    "a product to expand inside a matrix": (r"\begin{pmatrix} (x+1)(x-1) & 0 \\ 0 & 1 \end{pmatrix}",
                                            r"\begin{pmatrix} x^2-1 & 0 \\ 0 & 1 \end{pmatrix}"),
    "a number times a sum inside a matrix": (r"\begin{pmatrix} 3(x+2) \\ 2(x-1) \end{pmatrix}",
                                             r"\begin{pmatrix} 3x+6 \\ 2x-2 \end{pmatrix}"),
    "a root of a number times an unknown in a denominator": (r"\frac{6}{\sqrt{3x}}", r"\frac{2\sqrt{3x}}{x}"),
    "a root of a number times a constant in a denominator": (r"\frac{1}{\sqrt{2\pi}}", r"\frac{\sqrt{2\pi}}{2\pi}"),
    "a root's index to reduce": (r"\sqrt[4]{4}", r"\sqrt{2}"),
    "a sixth root of a cube": (r"\sqrt[6]{8}", r"\sqrt{2}"),
    "powers of e over a number times e": (r"\frac{e^3}{2e}", r"\frac{e^2}{2}"),
    "a sum of powers of e over e": (r"\frac{e^2+e}{e}", "e+1"),
    "powers of e over a number times a power of e": (r"\frac{e^5}{3e^2}", r"\frac{e^3}{3}"),
    # a denominator left to rationalise: a root of a number in it (and the gold answer has none)
    "a square root in a denominator": (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}"),
    "a square root in a denominator, over a number": (r"\frac{2}{\sqrt{3}}", r"\frac{2\sqrt{3}}{3}"),
    "a root that divides its numerator": (r"\frac{6}{\sqrt{3}}", r"2\sqrt{3}"),
    "a sum with a root in a denominator": (r"\frac{1}{1+\sqrt{2}}", r"\sqrt{2}-1"),
    "a quotient of roots": (r"\frac{\sqrt{3}}{\sqrt{2}}", r"\frac{\sqrt{6}}{2}"),
    "a cube root in a denominator": (r"\frac{1}{\sqrt[3]{2}}", r"\frac{\sqrt[3]{4}}{2}"),
    "a number times a root in a denominator": (r"\frac{1}{2\sqrt{2}}", r"\frac{\sqrt{2}}{4}"),
    "a negative fractional power of a number": ("2^{-1/2}", r"\frac{\sqrt{2}}{2}"),
    "a root in the denominator of an unknown": (r"\frac{x}{\sqrt{2}}", r"\frac{x\sqrt{2}}{2}"),
    # a number times a sum with an unknown where the gold answer is expanded, or the other way round
    "a number times a sum to expand": ("3(x+2)", "3x+6"),
    "a negative number times a sum": ("-3(x-2)", "6-3x"),
    "a number times a sum inside a sum": ("x^2+2(x+1)", "x^2+2x+2"),
    "an expansion for a number times a sum": ("3x+6", "3(x+2)"),
    # a fraction whose numbers, in its numerator and its denominator, share a factor
    "a fraction over a number times a sum": (r"\frac{6}{3(x+2)}", r"\frac{2}{x+2}"),
    "a fraction over a number times an unknown": (r"\frac{4}{2x}", r"\frac{2}{x}"),
    "a fraction to reduce to one over": (r"\frac{2}{4x}", r"\frac{1}{2x}"),
    "a fraction of unknowns to reduce": (r"\frac{6x}{3y}", r"\frac{2x}{y}"),
    "a negative fraction to reduce": (r"\frac{6}{-3x}", r"-\frac{2}{x}"),
    "a decimal over a number times an unknown": (r"\frac{1.5}{3x}", r"\frac{0.5}{x}"),
    "a fraction with a constant to reduce": (r"\frac{6}{4\pi}", r"\frac{3}{2\pi}"),
}

# (answer in the box, gold): correct answers just inside each rule's boundary.
ACCEPTED = [
    ("x = 1,125", "1, 125"),  # a gold list: the comma separates two answers, not thousands
    ("(x = 2,125)", "2125"),  # a bracket on one side only: the number's thousands, not a pair
    ("9801", "x = 9801"),
    ("x = 3, 4", "3, 4"),
    ("x = 3, y = 4", "x = 3, y = 4"),
    ("3, x = 4", "3, x = 4"),  # a set that mixes a number and an assignment, as the gold writes it
    (r"\binom{4}{2} \equiv 6", "6"),  # work before an equivalence, read as before an "="
    (r"52_8 \equiv 42", "42"),
    (r"x^2 \cdot x", "x^3"),  # one operation more than the gold
    (r"\{x \cdot x \cdot x\}", "x^3"),  # ... in braces: the brackets of a set are free
    (r"1.601 \times 10^{-19}", r"1.6 \times 10^{-19}"),  # within 0.1 %
    ("0.00000001, 1", "10^{-8}, 1"),
    ("0.000000010004", "10^{-8}"),  # off in its fifth digit only
    ("[0.00000001, 1]", "[10^{-8}, 1]"),
    ("0.0005", r"0.05\%"),
    ("0, 1", "0, 1"),  # a zero in the gold is no small number
    ("0", "0"),
    ("52_8 = 42", "42"),  # the conversion shown: only the value after the last "=" is in a base
    (r"52_{\,8}", "52_8"),  # LaTeX spacing in a base subscript
    (r"17 \frac{1}{5}", r"\frac{86}{5}"),  # a proper mixed number
    ("f(2) 3", "3 f(2)"),  # an integer that is a function's argument is no number of its own
    ("x = 9801", "x = 9801"),
    (r"\{x = 9801\}", "x = 9801"),
    ("x = 9801", r"\{x = 9801\}"),
    ("x = 0.5", r"x = \frac{1}{2}"),
    ("x = -2, x = 1", "x = 1, x = -2"),
    (r"x = 1.6 \times 10^{-19}", r"x = 1.6 \times 10^{-19}"),
    (r"\{1.6 \times 10^{-19}\}", r"1.6 \times 10^{-19}"),
    (r"1, 1.6 \times 10^{-19}", r"1.6 \times 10^{-19}, 1"),  # a set's small element matched in any order
    (r"\frac{1}{2}", "0.5"),
    ("9801 = x", "x = 9801"),
    ("1 = y, 9801 = x", "x = 9801, y = 1"),
    ("(2, 5)", "(2, 5)"),
    (r"(-\infty, 0) \cup [42, \infty)", r"(-\infty,0)\cup[42,\infty)"),
    (r"x \in [\frac19, \infty)", r"[\frac19,\infty)"),
    (r"(-\sqrt{2}, \sqrt{2})", r"(-\sqrt2, \sqrt2)"),
    (r"\sqrt{2}", r"\sqrt2"),  # a root that is not a whole number is written
    ("4^{50} x", "2^{100} x"),  # arithmetic the gold leaves, written another way
    (r"2^{-10}", r"\frac{1}{2^{10}}"),
    (r"\frac{1}{2^{10}}", r"2^{-10}"),
    (r"\left(\frac{1}{2}\right)^{20}", r"\frac{1}{2^{20}}"),
    (r"1-2^{-10}", r"1-\frac{1}{2^{10}}"),
    (r"\frac{2^{10}-1}{2^{10}}", r"1-\frac{1}{2^{10}}"),
    (r"\frac{1}{3}\cdot 2^{2007}", r"\frac{2^{2007}}{3}"),
    (r"\frac{1}{2}(3^{100}+1)", r"\frac{3^{100}+1}{2}"),
    (r"\frac{2^{10}}{3^{10}}", r"\left(\frac{2}{3}\right)^{10}"),
    (r"1 - \left(\frac{5}{6}\right)^{10}", r"1-\frac{5^{10}}{6^{10}}"),
    (r"9 \cdot 2^{2007}", r"3^2 \cdot 2^{2007}"),
    (r"2(2^{2006}-1)", r"2^{2007}-2"),
    (r"(3x)^2", r"(3x)^2"),  # a power of a product the gold writes too
    ("(x+2)(x+5)", "(x+5)(x+2)"),  # a factored gold
    (r"(x+1)^2 + 3", r"3 + (x + 1)^2"),
    (r"\frac{x + 2}{4}", r"\frac{x+2}{4}"),  # a fraction whose numerator shares no factor with 4
    (r"\frac{3}{2x}", r"\frac{1.5}{x}"),  # the reciprocal of a product: no power left to take
    (r"2(1+\sqrt{3})", r"2+2\sqrt{3}"),  # a number times a sum without an unknown
    (r"\frac{1}{2}(x+1)", r"\frac{x+1}{2}"),  # the reciprocal of an integer times a sum is a fraction
    (r"\frac{x+1}{2}", r"\frac{x}{2}+\frac{1}{2}"),
    ("-(x-2)", "2-x"),  # a sign
    ("3(x+2)", "3(2+x)"),  # a number times a sum the gold writes too
    # only an integer times a polynomial, as a term of the answer, is judged
    (r"\frac{3}{2}(x+1)", r"\frac{3}{2}x+\frac{3}{2}"),
    ("0.5(x+1)", "0.5x+0.5"),
    (r"\frac{3(x+1)}{2}", r"\frac{3x+3}{2}"),
    ("2(2^{n}-1)", "2^{n+1}-2"),
    (r"\sqrt{2x+2}", r"\sqrt{2(x+1)}"),
    (r"\frac{2n+2}{n}", r"\frac{2(n+1)}{n}"),
    ("y = 3(x+2)", "y = 3x+6"),  # an equation may take either form
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),  # a rationalised denominator for a gold that is not
    (r"\frac{1}{\sqrt{x}}", r"\frac{\sqrt{x}}{x}"),  # a root of an unknown is not judged
    (r"\frac{2}{3(x+2)}", r"\frac{2}{3x+6}"),  # numbers in lowest terms across the fraction
    (r"-\frac{1}{3x}", r"\frac{-1}{3x}"),
    (r"\frac{5}{6y}", r"\frac{5y^{-1}}{6}"),
    ("e^{-1}", r"\frac{1}{e}"),  # a power of e is a written number
    ("e^{1/2}", r"\sqrt{e}"),
    (r"\frac{x}{\sqrt{2}}", r"\frac{1}{\sqrt{2}} x"),  # a root in a denominator the gold has too
    (r"\frac{x}{3 \cdot 2}", r"\frac{x}{2 \cdot 3}"),  # a denominator's product the gold leaves too
    (r"2\sqrt{2x}", r"2\sqrt{2}\sqrt{x}"),  # the number in a root is no denominator's
    (r"1+(2x)^{-1}", r"\frac{2x+1}{2x}"),  # nor is a number beside a reciprocal in a sum
    (r"\sqrt{2+\sqrt{3}}", r"\frac{\sqrt{6}+\sqrt{2}}{2}"),  # a root inside a root is in no denominator
    (r"e^{\sqrt{2}}", r"e^{\sqrt{2}}"),
    (r"\pi\sqrt{\pi}", r"\pi^{3/2}"),  # a whole power and a root of one constant
    (r"\frac{\sqrt{e}}{e}", "e^{-1/2}"),
    (r"\frac{1}{\sqrt{e}}", "e^{-1/2}"),  # the reciprocal of a positive power of e
    (r"\frac{1}{e^{2}}", "e^{-2}"),
    (r"\frac{1}{-2x}", r"-\frac{1}{2x}"),  # a sign in a denominator is no number to reduce
    (r"\frac{3}{-4(x+1)}", r"-\frac{3}{4(x+1)}"),
    (r"\frac{1}{e^{\sqrt{2}}}", r"e^{-\sqrt{2}}"),  # a root in an exponent is in no denominator
    (r"\frac{1}{2^{\sqrt{2}}}", r"2^{-\sqrt{2}}"),
    (r"\frac{2x}{2x+1}", r"\frac{2x}{1+2x}"),  # a denominator sum with no factor in common
    (r"\sqrt[3]{e^2}", "e^{2/3}"),  # a root of a power of e with nothing to take out
    (r"e\sqrt{e}", "e^{3/2}"),
    (r"\arccos\frac{1}{\sqrt{5}}", r"\arccos\frac{\sqrt{5}}{5}"),  # a function's argument is no denominator
    (r"e^{1/\sqrt{2}}", r"e^{\frac{\sqrt{2}}{2}}"),  # nor is an exponent
    (r"2^{1/\sqrt{2}}", r"2^{\frac{\sqrt{2}}{2}}"),
    (r"\frac{x^{2}-1}{x-1}", r"\frac{x^2 - 1}{x - 1}"),  # a division the gold leaves too
    (r"\frac{1.5}{x}", r"\frac{3}{2x}"),
    (r"\frac{\log 3}{\log 2}", r"\log_2 3"),  # the change of base: log(3, 10) and log(2, 10) share only 1/log(10)
    (r"\frac{\log x}{\log 2}", r"\log_2 x"),
    (r"\frac{x+1}{x^2+1}", r"\frac{x+1}{x^2+1}"),  # nothing shared
    (r"\frac{1}{x(x+1)}", r"\frac{1}{x^2+x}"),
    ("1.5(2x+4)", "3x+6"),  # a decimal that is not whole times a sum is not judged
    (r"\frac{1}{\sqrt{x}}", "x^{-1/2}"),  # a root of an unknown alone is not judged
    (r"\frac{1}{\sqrt{xy}}", r"\frac{\sqrt{xy}}{xy}"),  # nor a root of unknowns
    (r"\frac{1}{\sqrt{2\pi}}", r"\frac{1}{\sqrt{2 \pi}}"),
    (r"\sqrt[3]{2}", r"2^{1/3}"),
    (r"\sqrt[3]{4}", "2^{2/3}"),  # a root whose index cannot be reduced, of a power of a smaller base
    (r"\sqrt[4]{8}", "2^{3/4}"),
    (r"\frac{\pi}{2e}", r"\frac{\pi e^{-1}}{2}"),
    (r"\frac{e}{e+1}", r"\frac{e}{1+e}"),
    (r"\begin{pmatrix} x+1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 1+x \\ 2 \end{pmatrix}"),
    # one fraction in lowest terms for a gold sum of fractions with an unknown in a denominator
    (r"\frac{x+2}{2x}", r"\frac{1}{x}+\frac{1}{2}"),
    (r"\frac{-x-2}{2x}", r"-\frac{1}{x}-\frac{1}{2}"),
    (r"\frac{2x+1}{x^2+x}", r"\frac{1}{x}+\frac{1}{x+1}"),
    # a sign and a one are no arithmetic: -\frac{1}{x} is parsed -1 \cdot 1 \cdot x^{-1}
    (r"-\frac{1}{x}", r"\frac{-1}{x}"),
    (r"1-\frac{1}{n+1}", r"\frac{n}{n+1}"),
    (r"x-\frac{1}{x}", r"\frac{x^2-1}{x}"),
    # a factored denominator is a fraction as written, not a product to expand
    (r"\frac{2}{(x-1)(x+1)}", r"\frac{2}{x^2-1}"),
    (r"\frac{1}{(x-2)^2}", r"\frac{1}{x^2-4x+4}"),
    (r"\frac{x+1}{x}", r"1+\frac{1}{x}"),  # a sum over an unknown is no monomial times a sum
    # exponent laws applied, or left as the gold leaves them; a root with nothing to take out
    ("a^3b^3", "(ab)^3"),
    ("x^6", "(x^2)^3"),
    (r"\frac{1}{x^2}", "(x^2)^{-1}"),
    (r"\sqrt{2x}", r"\sqrt{2x}"),
    (r"\sqrt{2x}", r"\sqrt{2}\sqrt{x}"),  # nothing to take out of the root: no arithmetic left
    ("(ab)^3", "(ba)^3"),  # a power of a product the gold leaves too
    # a curve's equation in either form
    (r"y = 2(x-1)^2 + 3", r"y = 2x^2 - 4x + 5"),
    (r"y = (x-1)(x-3)", r"y = x^2 - 4x + 3"),
    # an equation in completed-square form for an expanded one: a circle's standard form
    (r"(x-1)^2 + (y+2)^2 = 9", r"x^2 + y^2 - 2x + 4y - 4 = 0"),
    (r"\frac{1+\sqrt{5}}{2}", r"\frac{1+\sqrt5}{2}"),
    (r"\frac{3\sqrt{2}}{2}", r"\frac{3}{\sqrt{2}}"),
    (r"\sqrt{6}", r"\sqrt{2}\sqrt{3}"),  # a product of radicals the gold leaves, simplified
    (r"52\,_8", "52_8"),
    (r"\alpha + \gamma", r"\alpha + \gamma"),  # gamma as a name, not applied
    ("3/4", r"\frac{3}{4}"),  # a fraction in lowest terms, with a slash
    (r"2\frac{1}{3}", r"\frac{7}{3}"),
    (r"\frac{1}{2}, \frac{3}{4}", r"\frac12, \frac34"),
    (r"\frac{25\pi}{4}", r"6.25\pi"),
    (r"\frac{\sqrt{3}}{2}\pi", r"\frac{\pi\sqrt{3}}{2}"),
    # written numbers inside expressions: signs, lowest-terms fractions, reciprocals, powers of ten
    (r"\frac{1}{10^{3}}", "0.001"),
    (r"x \cdot 10^{3}", "1000x"),
    (r"2^{2007} - 1", "2^{2007}-1"),  # arithmetic the gold leaves too
    (r"9^{9^{9}} + x", r"9^{9^{9}} + x"),  # ... too large to compute: not computed, so not cut off by the time limit
    ("1024 x", "2^{10} x"),
    (r"\frac{2}{3}x", r"\frac{2x}{3}"),
    (r"-\frac{\sqrt{3}}{2}", r"-\frac{\sqrt{3}}{2}"),
    (r"\frac{3\sqrt{2}}{4}", r"\frac{3 \sqrt 2}{4}"),
    ("3:2", r"\frac{3}{2}"),
    ("x^{12}/4", r"\frac{x^{12}}{4}"),  # a slash after a power divides the power, not 12
    ("(x + 12)/4", r"\frac{x + 12}{4}"),
    (r"{3 \over 4}", "0.75"),
    (r"\frac12", "0.5"),
    (r"\frac{-1}{2}", r"-\frac{1}{2}"),  # a signed fraction in lowest terms
    ("-3/4", r"-\frac{3}{4}"),
    (r"3\frac{1}{2}", r"\frac{7}{2}"),  # a mixed number's proper fraction
    (r"(-\infty, 0) \cup (0, \infty)", r"(-\infty,0)\cup(0,\infty)"),  # a union the gold writes too
    (r"\$18", "18"),
    ("x - 3", "-3 + x"),
    (r"\frac{x + 1}{2}", r"\frac{1}{2}x + \frac{1}{2}"),
    ("3 + 4i", "4i + 3"),
]


@pytest.mark.parametrize("name", list(REFUSED))
def test_an_answer_just_past_a_rule_is_refused(name):
    """Each rule refuses the answer just past its boundary, which math-verify alone accepts."""
    answer, gold = REFUSED[name]
    assert scores([(answer, gold)], PLAIN) == [1.0]
    assert scores([(answer, gold)]) == [0.0]


@pytest.mark.parametrize(("answer", "gold"), ACCEPTED)
def test_an_answer_just_inside_the_rules_still_scores_one(answer, gold):
    """No false refusals at the rules' boundaries."""
    assert scores([(answer, gold)]) == [1.0]


def test_a_pair_in_sized_brackets_is_not_one_number():
    r"""``\left(1,125\right)`` is the pair (1, 125) like ``(1,125)``: its comma is not a thousands separator."""
    assert scores([(r"\left(1,125\right)", "1125"), (r"\left(1,125\right)", r"\left(1, 125\right)")]) == [0.0, 1.0]


def test_a_first_group_of_four_digits_is_no_digit_grouping():
    """Only groups of three digits are joined: ``1234 567`` is two numbers (latex2sympy's mixed number), refused."""
    assert scores([("1234 567", "1234567"), ("1 234 567", "1234567")]) == [0.0, 1.0]


def test_answer_rules_off_is_math_verify_s_comparison_of_bases_too():
    """``answer_rules=False`` keeps only the whole-box rule: math-verify drops a base subscript, and so does it."""
    assert scores([("52_9", "52_8")], PLAIN) == [1.0]
    assert scores([("52_9", "52_8")]) == [0.0]
    assert check("52_9", "52_8", answer_rules=False) and not check("52_9", "52_8")


# ------------------------------------------------------------------------------------------------------ zero3


class FakeGathered:
    """DeepSpeed's ``GatheredParameters`` stand-in: records its calls; inside, a partitioned parameter holds its
    whole value (``ds_whole``); on leaving, it is partitioned again (its storage reused, as DeepSpeed's buffers)."""

    calls = []

    def __init__(self, parameters, modifier_rank=None):
        self.parameters, self.modifier_rank = list(parameters), modifier_rank
        FakeGathered.calls.append(self)

    def __enter__(self):
        for parameter in self.parameters:
            if hasattr(parameter, "ds_whole"):
                parameter.data.copy_(parameter.ds_whole)
        return self

    def __exit__(self, *exc):
        for parameter in self.parameters:
            if hasattr(parameter, "ds_whole"):
                parameter.data.zero_()
        return False


@pytest.fixture
def fake_deepspeed(monkeypatch):
    module = types.ModuleType("deepspeed")
    module.zero = types.SimpleNamespace(GatheredParameters=FakeGathered)
    monkeypatch.setitem(sys.modules, "deepspeed", module)
    FakeGathered.calls = []
    return FakeGathered


def partitioned_model():
    """A two-layer model whose second layer's weight is marked as a ZeRO-3 partition (zeros outside a gather)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    weight = model[1].weight
    weight.ds_id = 7
    weight.ds_whole = torch.arange(4.0).reshape(2, 2) + 1
    with torch.no_grad():
        weight.zero_()
    return model


def test_zero3_a_partition_is_marked_by_ds_id():
    """A parameter is a ZeRO-3 partition when DeepSpeed gave it a ``ds_id``; one partitioned parameter is enough."""
    model = partitioned_model()
    assert zero3.is_partitioned(model[1].weight) and not zero3.is_partitioned(model[0].weight)
    assert zero3.has_partitioned_parameters(model)
    assert not zero3.has_partitioned_parameters(nn.Linear(2, 2))


def test_zero3_nothing_partitioned_needs_no_deepspeed(monkeypatch):
    """Without partitions ``gathered`` is a no-op and ``whole_state_dict`` the plain state dict; DeepSpeed unused."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # importing it raises
    model = nn.Linear(2, 2)
    assert isinstance(zero3.gathered(list(model.parameters()), modifier_rank=0), contextlib.nullcontext)
    state = zero3.whole_state_dict(model)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


def test_zero3_gathered_passes_every_parameter_and_the_modifier_rank(fake_deepspeed):
    """Any partitioned parameter among them gathers them all, with the caller's ``modifier_rank``."""
    model = partitioned_model()
    parameters = list(model.parameters())
    with zero3.gathered(parameters, modifier_rank=0):
        assert torch.equal(model[1].weight, model[1].weight.ds_whole)
    assert len(fake_deepspeed.calls) == 1
    assert fake_deepspeed.calls[0].parameters == parameters and fake_deepspeed.calls[0].modifier_rank == 0
    zero3.gathered(parameters)
    assert fake_deepspeed.calls[1].modifier_rank is None


def test_zero3_whole_state_dict_gathers_and_copies(fake_deepspeed):
    """The whole weights of a partitioned model, gathered (all parameters, read only) and copied: still whole after
    the gather ends, and sharing no storage with the parameters."""
    model = partitioned_model()
    state = zero3.whole_state_dict(model)
    assert len(fake_deepspeed.calls) == 1
    call = fake_deepspeed.calls[0]
    assert call.parameters == list(model.parameters()) and call.modifier_rank is None
    assert torch.equal(state["1.weight"], model[1].weight.ds_whole)  # not the zeros left after the gather
    assert torch.equal(state["0.weight"], model[0].weight)
    assert all(not tensor.requires_grad for tensor in state.values())
    assert state["0.weight"].data_ptr() != model[0].weight.data_ptr()
