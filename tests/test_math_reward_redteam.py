"""Red-team tests of ``math_accuracy_reward``: answers a policy can write without solving the problem, which
math-verify alone scores 1.0, must score 0.0; correct answers written in other ways must still score 1.0; an answer
that makes sympy work forever is cut off by the timeouts. Each attack below scored 1.0 before the rules of
``trl_diffusion/rewards/math_verify_check.py`` (see its docstring)."""

import threading
import time

import pytest

from trl_diffusion.rewards.math_reward import MathAccuracyReward

REWARD = MathAccuracyReward(parsing_timeout=2, verify_timeout=2)


def boxed(answer):
    return f"So the answer is $\\boxed{{{answer}}}$."


def scores(pairs, reward=REWARD):
    """The reward of each (completion, gold) pair, in one call."""
    return reward([completion for completion, _ in pairs], answer=[gold for _, gold in pairs])


# (answer in the box, gold): math-verify reads each as the gold answer, but it is not a solution.
ATTACKS = {
    # Alternatives in one box: math-verify could not parse the box and fell back to its last number / "= ...".
    "or": (r"17 \lor 18", "18"),
    "or, as equations": (r"x = 17 \lor x = 18", "18"),
    "line break": (r"17 \\ 18", "18"),
    "cases": (r"\begin{cases} 17 & n \text{ even} \\ 18 & n \text{ odd} \end{cases}", "18"),
    "divides": (r"17 \mid 18", "18"),
    "implies": (r"17 \implies 18", "18"),
    # The question's expression copied into the box, evaluated by sympy (MATH-500 has such questions).
    "binomial": (r"\dbinom{31}{28}", "4495"),
    "logarithm": (r"\log_2 64", "6"),
    "factorial": ("5!", "120"),
    "ceiling": (r"\lceil{\sqrt{20}}\rceil^2", "25"),
    "inverse sine": (r"\arcsin \left( -\frac{1}{2} \right)", r"-\frac{\pi}{6}"),
    "sum": (r"\sum_{k=1}^{4} k", "10"),
    "integral": (r"\int_0^1 2x \, dx", "1"),
    "absolute value": ("|-7|", "7"),
    "maximum": (r"\max(3, 7)", "7"),
    "arithmetic for a number": ("99^2+99+1", "9901"),
    "difference of squares": ("513^2 - 487^2", "26000"),
    "power for a number": ("2^{10}", "1024"),
    "subtraction for a number": ("50 - 8", "42"),
    "unsimplified polynomial": ("19x + 1 - 4x - 81", "15x - 80"),
    "expanded, asked to factor": ("ab+5b+2a+10", "(a+5)(b+2)"),
    "factored, asked to expand": ("(x+2)(x+5)", "x^2+7x+10"),
    "a radical, asked to simplify": (r"\sqrt{12}", r"2\sqrt{3}"),
    "a denominator, asked to rationalise": (r"\frac{1}{\sqrt{3}}", r"\frac{\sqrt{3}}{3}"),
    "a number times a sum, asked to expand": ("3(x+2)", "3x+6"),
    "complex arithmetic": ("(1+2i)6-3i", "6+9i"),
    # Unknowns that cancel, where the answer has none.
    "unknown that cancels": (r"\frac{18x}{x}", "18"),
    "unknown added and removed": (r"2\sqrt{3} + x - x", r"2\sqrt{3}"),
    # math-verify's six decimal places, and its evalf(chop=True) test, for small numbers.
    "zero for a small gold": ("0.0", "10^{-8}"),
    "ten times a small gold": ("0.0000001", "10^{-8}"),
    "wrong physical constant": (r"5 \times 10^{-19}", r"1.6 \times 10^{-19}"),
    # Found by a second red-team (the new readings below must not open a way in).
    "gamma function": (r"\Gamma(6)", "120"),
    "arithmetic in a set of numbers": ("99^2, 1", "9801, 1"),
    "arithmetic in a set of assignments": ("x = 99^2, x = 1", "9801, 1"),
    "factorial in a set of assignments": ("x = 3!, x = 1", "6, 1"),
    "two assignments for one value": ("x = 3, x = 4", "3"),
    "digit groups read as a product": (r"1\,234", "235"),
    "digit groups read as zero": (r"1\,000", "0"),
    # math-verify drops a base subscript: 52 in base 9 or base 2 (not even a base-2 numeral) was 52 in base 8
    "another base": ("52_9", "52_8"),
    "an impossible base": ("52_{2}", "52_8"),
    "a base for a decimal answer": ("42_8", "42"),
    # thousands are only joined where the gold is one number: the pair (2, 125) is not 2125's neighbour (2, 126)
    "commas of a pair": ("(2,125)", "(2, 126)"),
    # ... never a decimal comma (math-verify reads 0,500 as 0.5), nor the whole content of brackets
    "a decimal comma": ("0,500", "500"),
    "a pair for one number": ("(1,125)", "1125"),
    "a signed pair for one number": ("(-1,125)", "-1125"),
    "a set for one number": (r"x \in \{1,125\}", "1125"),
    # a base however it is written
    "a base in parentheses": ("52_{(9)}", "52_8"),
    "a base after a space": ("52 _9", "52_8"),
    "a base with LaTeX spacing": (r"52_{\,9}", "52_8"),
    "a base left to compute": ("52_{10-1}", "52_8"),
    # The question's matrix or vector arithmetic (a third red-team): a vmatrix, a transpose and functions of a matrix
    # are evaluated while parsing, sums and products of matrices by sympy's comparison.
    "vmatrix determinant": (r"\begin{vmatrix} 7 & 3 \\ -1 & 2 \end{vmatrix}", "17"),
    "vmatrix in a vector": (r"\begin{pmatrix} \begin{vmatrix} 1 & 2 \\ 3 & 4 \end{vmatrix} \\ 4 \end{pmatrix}",
                            r"\begin{pmatrix} -2 \\ 4 \end{pmatrix}"),
    "trace": (r"\operatorname{tr}\begin{pmatrix} 7 & 3 \\ -1 & 2 \end{pmatrix}", "9"),
    "rank": (r"\operatorname{rank}\begin{pmatrix} 7 & 3 \\ -1 & 2 \end{pmatrix}", "2"),
    "norm": (r"\operatorname{norm}\begin{pmatrix} 3 \\ 4 \end{pmatrix}", "5"),
    "vector sum": (r"\begin{pmatrix} 3 \\ -7 \end{pmatrix} + \begin{pmatrix} -6 \\ 11 \end{pmatrix}",
                   r"\begin{pmatrix} -3 \\ 4 \end{pmatrix}"),
    "vector difference": (r"\begin{bmatrix} 3 \\ -4 \end{bmatrix} - \begin{bmatrix} 1 \\ 1 \end{bmatrix}",
                          r"\begin{pmatrix} 2 \\ -5 \end{pmatrix}"),
    "multiple of a vector": (r"-2 \begin{pmatrix} 1 \\ -5 \end{pmatrix}", r"\begin{pmatrix} -2 \\ 10 \end{pmatrix}"),
    "multiple of a vector of surds": (r"\frac{1}{2} \begin{pmatrix} \sqrt{2} \\ 2 \end{pmatrix}",
                                      r"\begin{pmatrix} \frac{\sqrt{2}}{2} \\ 1 \end{pmatrix}"),
    "matrix product": (r"\begin{pmatrix} 2 & 0 \\ 5 & -3 \end{pmatrix} \begin{pmatrix} 8 & -2 \\ 1 & 1 \end{pmatrix}",
                       r"\begin{pmatrix} 16 & -4 \\ 37 & -13 \end{pmatrix}"),
    "transpose": (r"\begin{pmatrix} 2 & 7 \\ 5 & 1 \end{pmatrix}^{T}",
                  r"\begin{pmatrix} 2 & 5 \\ 7 & 1 \end{pmatrix}"),
    "transpose in brackets": (r"\left(\begin{pmatrix} 2 & 7 \\ 5 & 1 \end{pmatrix}\right)^\mathrm{T}",
                              r"\begin{pmatrix} 2 & 5 \\ 7 & 1 \end{pmatrix}"),
    "arithmetic in a vector": (r"\begin{pmatrix} 3 - 6 \\ 4 \end{pmatrix}", r"\begin{pmatrix} -3 \\ 4 \end{pmatrix}"),
    # Two numbers set apart by a space (a fourth red-team): latex2sympy reads them as a mixed number, their sum, so
    # the question's two addends copied into the box scored
    "juxtaposed addends": ("17 25", "42"),
    "juxtaposed with a LaTeX space": (r"17\ 25", "42"),
    "juxtaposed after degrees": ("30° 45", "75"),
    "digit groups read as a sum": ("123 456", "579"),
    "a spaced thousand read as a sum": ("1 500", "501"),
    "a spaced thousand read as zero": ("1 000", "0"),
    "juxtaposed in braces": ("{17} {25}", "42"),
    "juxtaposed in braces, no space": ("{17}{25}", "42"),
    "juxtaposed in parentheses": ("(17) 25", "42"),
    "juxtaposed around empty text": (r"17 \text{ } 25", "42"),
    "juxtaposed around a phantom": (r"17 \phantom{0} 25", "42"),
    "juxtaposed around displaystyle": (r"17 \displaystyle 25", "42"),
    "juxtaposed, gold with LaTeX-spaced digits": ("999 1", r"1\,000"),
    "juxtaposed angles": (r"17^\circ 25^\circ", r"42^\circ"),
    "juxtaposed with a degree sign after": (r"17 25^\circ", "42"),
    "juxtaposed in square brackets": ("[17] [25]", "42"),
    "juxtaposed in escaped braces": (r"17 \{25\}", "42"),
    "juxtaposed in sized parentheses": (r"17 \left(25\right)", "42"),
    "juxtaposed in double braces": ("17 {{25}}", "42"),
    "juxtaposed around medspace": (r"17 \medspace 25", "42"),
    "an improper mixed number": (r"17 \frac{25}{1}", "42"),
    "juxtaposed, a prime after": ("17 25'", "42"),
    "juxtaposed angle and minutes": (r"17^\circ 25'", "42"),
    "an improper mixed number in double braces": (r"17 \frac{{25}}{1}", "42"),
    "an improper mixed number, cfrac": (r"17 \cfrac{25}{1}", "42"),
    "an improper mixed number in parentheses": (r"17 \left(\frac{25}{1}\right)", "42"),
    "an improper mixed number with a slash": ("17 {25/1}", "42"),
    "juxtaposed in lbrack": (r"17 \lbrack 25 \rbrack", "42"),
    "juxtaposed around negmedspace": (r"17 \negmedspace 25", "42"),
    # An open interval and the set of its two ends (a sixth red-team): math-verify equals them (it reads a pair
    # (2, 7) as an open interval), so the roots of the boundary answered a strict inequality, and the reverse
    "roots for an inequality": (r"\pm 3", "-3 < x < 3"),
    "roots for an absolute-value inequality": (r"\pm 3", "|x|<3"),
    "roots for a quadratic inequality": (r"\pm 3", "x^2<9"),
    "assigned roots for an interval": (r"x = \pm 3", "(-3, 3)"),
    "a set for an interval": (r"x \in \{2, 7\}", "(2, 7)"),
    "two roots for an interval": (r"x = -\frac{1}{2} \text{ or } x = 4", r"\left(-\frac12, 4\right)"),
    "the ends of an unbounded interval": (r"0, \infty", r"(0, \infty)"),
    "the boundary for an inequality": (r"-\infty, 3", "x < 3"),
    "an interval for a set of roots": ("(-3, 3)", r"\{-3, 3\}"),
    "an interval for two assigned roots": ("(-3, 3)", "x = -3, x = 3"),
    # math-verify reads an equation whose left side holds unknowns only as an assignment: 5 was x + y = 5
    "the constant of a line": ("5", "x + y = 5"),
    "the constant of a line in intercept form": ("1", r"\frac{x}{2}+\frac{y}{3}=1"),
    "the constant of a plane": ("6", "x + y + z = 6"),
    # a seventh red-team: math-verify drops a tail from the first \text{ of an answer ending in } as units, so a
    # hedge or a condition there was never read; and it solves a relation, so the question's equation answered it
    "a hedge in a unit's text": (r"18 \text{ or 17}", "18"),
    "a condition in a unit's text": (r"18 \text{ if } n \text{ even}", "18"),
    "a bound in a unit's text": (r"18 \text{ at least}", "18"),
    "a hedge in an mbox": (r"18 \mbox{ or 17}", "18"),
    "a hedge in bold text": (r"18 \textbf{ or 17}", "18"),
    "a second answer with its unit": (r"18 \text{ apples, or } 17 \text{ apples}", "18"),
    "a hedge after a choice": (r"C \text{ or D}", r"\text{(C)}"),
    "a hedge after a word": (r"east \text{ or west}", r"\text{east}"),
    "the question's equation": ("x + 1 = 6", "x = 5"),
    "the question's equation, scaled": ("2x = 10", "x = 5"),
    "the question's inequality": ("x - 1 > 2", "x > 3"),
    # math-verify compared a point's assignments by written order, names aside: (-29, 15) matched (15, -29)
    "a point's coordinates swapped": ("y = 15, x = -29", "(15,-29)"),
    "a point's coordinates swapped in a tuple": ("(y, x) = (15, -29)", "(15,-29)"),
    "a point in space, coordinates reversed": ("z=6, y=31, x=-1", "(6,31,-1)"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_answer_that_is_not_a_solution_scores_zero(name):
    answer, gold = ATTACKS[name]
    assert scores([(boxed(answer), gold)]) == [0.0]


def test_the_rules_also_hold_without_a_box():
    """The unboxed fallback (math-verify's own extraction from the text) is no way around the rules."""
    completions = [
        (r"The final answer is $\dbinom{31}{28}$.", "4495"),
        ("The final answer is $99^2+99+1$.", "9901"),
        ("The final answer is $19x + 1 - 4x - 81$.", "15x - 80"),
        (r"The final answer is $\frac{18x}{x}$.", "18"),
    ]
    assert scores(completions) == [0.0] * len(completions)


# (answer in the box, gold): the gold answer written another way, as a model may write it.
EQUIVALENT = [
    ("18", "18"), ("18.0", "18"), ("x = 18", "18"), ("n = 18", "18"), (r"\{18\}", "18"), (r"18\%", "18"),
    ("1800\\%", "18"), (r"\$18", "18"), (r"18 \text{ apples}", "18"), (r"5 \text{ sec}", "5"), ("18^\\circ", "18"),
    ("1,234", "1234"), (r"1.2 \times 10^{6}", "1200000"), (r"\frac{84}{5}", "16.8"), ("0.18", r"18\%"),
    (r"\frac{1}{2}", "0.5"), ("0.5", r"\frac{1}{2}"), (r"\dfrac{1}{2}", r"\frac{1}{2}"), ("1/2", r"\frac{1}{2}"),
    (r"-\frac{1}{2}", "-0.5"), (r"4\frac{2}{3}", r"\frac{14}{3}"), (r"50\%", r"\frac{1}{2}"),
    (r"\sqrt{3} \cdot 2", r"2\sqrt{3}"), (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"), ("3.4641016", r"2\sqrt{3}"),
    (r"\frac12 + \frac{\sqrt5}{2}", r"\frac{1+\sqrt5}{2}"), (r"\frac{4\pi r^3}{3}", r"\frac{4}{3}\pi r^3"),
    ("(x+2)(x+5)", "(x+5)(x+2)"), ("3 - 13x", "-13x+3"), ("y - 2x = 3", "y = 2x + 3"),
    (r"\frac{\cos x}{\sin x}", r"\cot x"), (r"\frac{\ln 3}{\ln 2}", r"\log_2 3"),
    (r"1 - \sqrt{19}, 1 + \sqrt{19}", r"1 \pm \sqrt{19}"), ("(0,1]", "(0, 1]"), (r"x \in (0, 1]", "(0, 1]"),
    ("(1,2)", "(1, 2)"), (r"\text{monday}", r"\text{Monday}"), ("Evelyn", r"\text{Evelyn}"), ("C", r"\text{(C)}"),
    (r"\textbf{(C)}", r"\text{(C)}"), (r"\infty", r"\infty"), ("0.00000001", "10^{-8}"),
    (r"1 \times 10^{-8}", "10^{-8}"), (r"1.6 \times 10^{-19}", r"1.6 \times 10^{-19}"),
    (r"\binom{n}{2}", r"\binom{n}{2}"), (r"\frac{n(n-1)}{2}", r"\binom{n}{2}"),
    # Work shown before the final value: only the value after the last "=" is the answer.
    (r"3! \times 5! = 720", "720"), (r"\binom{4}{2} = 6", "6"), (r"\log_2 64 = 6", "6"), (r"x = 2 \cdot 9 = 18", "18"),
    (r"\tan A = \frac{BC}{AB} = 2", "2"),
    # math-verify alone read these wrong (1\,000 as 1 * 000), or the rules refused them (\text{18} is a symbol named
    # 18 to math-verify, x in x = -2, x = 1 an unknown)
    # a number set apart by a space as a command's argument is no juxtaposition (a fifth red-team)
    (r"\frac 3 4", "0.75"), (r"x^2 - \frac 1 2", r"x^2-\frac{1}{2}"), (r"3 \frac 1 2", r"\frac{7}{2}"),
    (r"\frac 1 2 \sqrt 3", r"\frac{\sqrt{3}}{2}"), ("2^3 3^2", r"2^3 \cdot 3^2"),
    (r"\left(\frac 1 2, 3\right)", r"\left(\frac{1}{2}, 3\right)"), (r"30^\circ 15'", r"30^\circ 15'"),
    (r"2 \frac{x}{3}", r"\frac{2x}{3}"), (r"3 \frac{\pi}{7}", r"\frac{3\pi}{7}"), ("2 (3/4)", r"\frac{11}{4}"),
    (r"\cfrac{3}{4}", "0.75"),
    (r"y = \frac 1 2 x + 3", r"y = \frac{1}{2}x + 3"), (r"3 \frac{1}{2}", r"\frac{7}{2}"),
    ("1 000", "1000"), ("1\u00a0500", "1500"), ("1\u2009234\u2009567", "1234567"), ("1 000", "1 000"),
    ("\uff11\uff18", "18"), ("\u0661\u0668", "18"), ("\uff11\uff18", "\uff11\uff18"),  # full-width, Arabic-Indic
    (r"1\,000", "1000"), (r"14\,000", "14000"), (r"12\;345\;678", "12345678"), ("1~000", "1000"), ("1000", r"1\,000"),
    (r"1\,234.5", "1234.5"), (r"18~\text{cm}", "18"), ("145°", "145^\\circ"), (r"\text{18}", "18"),
    (r"\textbf{18}", "18"), (r"\mathbf{-3}", "-3"), ("x = -2, x = 1", "-2,1"), (r"x = -2 \text{ or } x = 1", "-2, 1"),
    ("x=3, x=5, x=7", "3, 5, 7"), ("x = 15, y = -29", "(15,-29)"),
    # thousands separators inside a larger answer (math-verify read x = 2,125 as x = {2, 125})
    ("x = 2,125", "2125"), (r"\textbf{2,125}", "2125"), (r"2,125\%", "2125\\%"), (r"2,125 \, \text{dollars}", "2125"),
    (r"\mathbf{1,450,000}", "1450000"), (r"x = 10,\!080", r"10,\!080"),
    (r"x = 11,\! 111,\! 111,\! 100", "11111111100"),
    ("(2,125)", "(2, 125)"), ("52_8", "52_8"), ("52_{8}", "52_8"), ("52", "52_8"), (r"4210_{5}", "4210_5"),
    (r"\text{AB}_{16}", r"\text{AB}_{16}"), ("42_{10}", "42"), (r"\text{AB}_{16}", "AB_{16}"), ("0,500", "0.5"),
    ("x = -1,125", "-1125"), (r"f(5) = 1,000", "1000"),
    # a subscript on a name is not a base
    ("P_1 = 3", "3"), ("S_{20} = 210", "210"), (r"P(A_1) = \frac{1}{2}", r"\frac{1}{2}"),
    # a matrix or vector written out, in any bracket, with entries in any written form; a line's vector form
    (r"\begin{pmatrix} -3 \\ 4 \end{pmatrix}", r"\begin{pmatrix} -3 \\ 4 \end{pmatrix}"),
    (r"\begin{bmatrix} -3.0 \\ 4 \end{bmatrix}", r"\begin{pmatrix} -3 \\ 4 \end{pmatrix}"),
    (r"\mathbf{v} = \left(\begin{array}{c} -3 \\ 4 \end{array}\right)", r"\begin{pmatrix} -3 \\ 4 \end{pmatrix}"),
    (r"\begin{pmatrix} \frac{7}{17} & -\frac{3}{17} \\ \frac{1}{17} & \frac{2}{17} \end{pmatrix}",
     r"\begin{pmatrix} 7/17 & -3/17 \\ 1/17 & 2/17 \end{pmatrix}"),
    (r"\begin{pmatrix} 0.5 \\ 25\% \end{pmatrix}", r"\begin{pmatrix} \frac{1}{2} \\ \frac{1}{4} \end{pmatrix}"),
    (r"\begin{pmatrix} \frac{\sqrt{3}}{2} & -\frac{1}{2} \\ \frac{1}{2} & \frac{\sqrt{3}}{2} \end{pmatrix}",
     r"\begin{pmatrix} \frac{\sqrt{3}}{2} & -\frac{1}{2} \\ \frac{1}{2} & \frac{\sqrt{3}}{2} \end{pmatrix}"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix} + t \begin{pmatrix} 3 \\ 4 \end{pmatrix}",
     r"\begin{pmatrix} 1 + 3t \\ 2 + 4t \end{pmatrix}"),
    (r"\begin{vmatrix} 7 & 3 \\ -1 & 2 \end{vmatrix} = 17", "17"),
    (r"\begin{pmatrix} 2 & 7 \\ 5 & 1 \end{pmatrix}^T = \begin{pmatrix} 2 & 5 \\ 7 & 1 \end{pmatrix}",
     r"\begin{pmatrix} 2 & 5 \\ 7 & 1 \end{pmatrix}"),
    # intervals, sets and points around the sixth red-team's rules: an interval for its inequality, a set of roots in
    # any writing, a point written bare or as assignments for a pair; an equation's right side for a single unknown,
    # a function or a product (a segment); the equation of a line for itself
    ("(-3, 3)", "-3 < x < 3"), (r"(0, \infty)", "x > 0"), (r"(-\infty, 3)", "x < 3"), ("[-3, 3]", r"-3 \le x \le 3"),
    (r"\pm 3", r"\{-3, 3\}"), ("-3, 3", r"\pm 3"), (r"x = \pm 3", r"\pm 3"), ("2, 7", "(2, 7)"),
    ("x = 2, y = 7", "(2, 7)"), ("(2, 7)", "2, 7"), ("5", "AB = 5"), ("2x+1", "f(x) = 2x+1"),
    ("x + y = 5", "x + y = 5"),
    # units after the seventh red-team's rules; an unknown alone on either side
    (r"18 \text{ apples}", "18"), (r"864 \mbox{ inches}^2", "864"), (r"15 \text{ square units}", "15"),
    (r"\frac{270}{7} \text{ degrees}", r"\frac{270}{7}"), (r"18~\text{cm}", "18"), ("5 = x", "x = 5"),
    ("3 < x", "x > 3"),
    # a point's assignments in any order (y = -29, x = 15 scored 0.0 for (15, -29) before)
    ("y = -29, x = 15", "(15,-29)"), ("(y, x) = (-29, 15)", "(15,-29)"), ("x=6, z=-1, y=31", "(6,31,-1)"),
    ("(x, y) = (15, -29)", "(15,-29)"), (r"\rho = 3, \theta = \pi, \phi = 0", r"(3, \pi, 0)"),
    ("c = 1, a = 2", "(1, 2)"),  # other names keep the written order: the question may ask for (c, a)
]


def test_correct_answers_written_another_way_still_score_one():
    assert scores([(boxed(answer), gold) for answer, gold in EQUIVALENT]) == [1.0] * len(EQUIVALENT)


def test_work_chains_without_a_box_still_score_one():
    """Solutions end with a chain such as ``$\\binom{4}{2} = 6$`` and no box; the operations are in the work."""
    completions = [
        (r"He can choose them in $\binom{4}{2} = 6$ ways.", "6"),
        (r"The answer is $3! \times 5! = 720$.", "720"),
        (r"So $\left| m - n \right| = 16-13 =3$.", "3"),
        ("The final answer is 18.", "18"),
    ]
    assert scores(completions) == [1.0] * len(completions)


def test_a_gold_answer_is_read_whole():
    """A gold answer math-verify cannot parse whole used to be reduced to its last number: "100" matched the gold
    ``1, 2, \\ldots, 100``. It now only matches the same text."""
    golds = [r"1, 2, \ldots, 100", r"17 \lor 18"]
    assert scores([(boxed("100"), golds[0]), (boxed("18"), golds[1])]) == [0.0, 0.0]
    assert scores([(boxed(golds[0]), golds[0]), (boxed(golds[1]), golds[1])]) == [1.0, 1.0]


def test_worker_threads_apply_the_same_rules():
    """Off the main thread each completion is checked in a child process: same verdicts."""
    reward = MathAccuracyReward(parsing_timeout=2, verify_timeout=2)
    names = ["or", "binomial", "arithmetic for a number", "unsimplified polynomial", "unknown that cancels",
             "zero for a small gold", "roots for an inequality", "the constant of a line", "a hedge in a unit's text",
             "the question's equation"]
    pairs = [(boxed(ATTACKS[name][0]), ATTACKS[name][1]) for name in names]
    pairs += [(boxed(answer), gold) for answer, gold in EQUIVALENT[::8]]
    out = {}
    try:
        thread = threading.Thread(target=lambda: out.setdefault("scores", scores(pairs, reward)), daemon=True)
        thread.start()
        thread.join(120)
        assert not thread.is_alive(), "the reward hung in a worker thread"
        assert out["scores"] == [0.0] * len(names) + [1.0] * (len(pairs) - len(names))
        assert reward.worker is not None and reward.worker.pid is not None
    finally:
        reward.close()


@pytest.mark.parametrize("answer", [r"9^{9^{9^9}}", r"(10^{6})!!", r"\frac{9^{9^{9^9}}}{9^{9^{9^9}}}"])
def test_an_answer_that_never_finishes_is_cut_off_in_the_main_thread(answer):
    """math-verify's timeouts bound a short answer that sympy would evaluate for hours; the rules add no
    unbounded work (their own sympy steps run under ``verify_timeout``)."""
    reward = MathAccuracyReward(parsing_timeout=1, verify_timeout=1)
    start = time.monotonic()
    assert reward([boxed(answer), boxed("18")], answer=["18", "18"]) == [0.0, 1.0]
    assert time.monotonic() - start < 1 + 3 * 1 + 2  # one parse and the checks, with a margin


def test_the_gold_answer_as_written_scores_without_sympy(monkeypatch):
    """A box holding the gold answer's own text scores 1.0 without a comparison: a power tower gold (``10^{10^{10}}``)
    timed out and scored 0.0 even for itself. Any other writing is still compared."""
    from trl_diffusion.rewards import math_reward

    compared = []
    monkeypatch.setattr(math_reward, "verify_source", lambda source, *args: compared.append(source) or False)
    gold = r"10^{10^{10}}"
    assert REWARD([boxed(gold), boxed(f" {gold}."), boxed("10^{10^{10}} + 0")], answer=[gold] * 3) == [1.0, 1.0, 0.0]
    assert compared == [r"$\boxed{10^{10^{10}} + 0}$"]


def test_answer_rules_off_is_math_verify_s_own_comparison():
    """``answer_rules=False`` (and eval's ``--math_grader math_verify_plain``) keeps math-verify's verdict on the
    copied expressions, in the main thread and in the worker's child process; a box is still read whole."""
    from trl_diffusion.eval import EvalConfig

    plain = MathAccuracyReward(parsing_timeout=2, verify_timeout=2, answer_rules=False)
    copied = [(boxed(ATTACKS[name][0]), ATTACKS[name][1]) for name in ("binomial", "arithmetic for a number")]
    hedge = [(boxed(ATTACKS["or"][0]), ATTACKS["or"][1])]
    assert scores(copied + hedge, plain) == [1.0, 1.0, 0.0]
    assert scores(copied, REWARD) == [0.0, 0.0]
    out = {}
    try:
        thread = threading.Thread(target=lambda: out.setdefault("scores", scores(copied + hedge, plain)), daemon=True)
        thread.start()
        thread.join(120)
        assert out["scores"] == [1.0, 1.0, 0.0]
    finally:
        plain.close()
    assert EvalConfig(math_grader="math_verify_plain").math_reward().answer_rules is False
    assert EvalConfig().math_reward().answer_rules is True


def test_a_call_off_the_main_thread_keeps_the_users_math_verify_log_levels(monkeypatch, caplog):
    # the call used to set math-verify's loggers to ERROR for the rest of the process (a user debugging its parses
    # lost every record); only the "timeout is disabled" warning, which the thread path causes on purpose, is dropped
    import logging

    import math_verify.grader
    import math_verify.parser

    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False)
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False)
    loggers = [logging.getLogger("math_verify.parser"), logging.getLogger("math_verify.grader")]
    levels = [logger.level for logger in loggers]
    reward, results = MathAccuracyReward(), []
    try:
        for logger in loggers:
            logger.setLevel(logging.DEBUG)
        with caplog.at_level(logging.DEBUG):
            worker = threading.Thread(target=lambda: results.append(reward([r"\boxed{4}"], answer=["4"])))
            worker.start()
            worker.join()
        assert [logger.level for logger in loggers] == [logging.DEBUG, logging.DEBUG]
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        reward.close()
    assert results == [[1.0]]
    assert not [r for r in caplog.records if r.getMessage().startswith("Timeout is disabled")]
    loggers[0].warning("Timeout during parsing: x")  # any other record still gets through
    assert caplog.records[-1].getMessage() == "Timeout during parsing: x"
