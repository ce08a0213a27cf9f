"""LeetCode's linked-list and binary-tree problems are decided outside the sandbox, so a program cannot forge them.

``newfacade/LeetCodeDataset`` rows define helpers in their prompt, which goes before the completion: ``list_node`` /
``tree_node`` build a test's structures from lists, ``is_same_list`` / ``is_same_tree`` compare them. Their tests
(``assert is_same_list(candidate(head=list_node([1, 2])), list_node([2, 1]))``, ``assert candidate(root=
tree_node([3, 9, 20])) == 2``) used to run unverified, inside the sandbox, where the program decides the verdict:
redefining ``is_same_list``, or returning nodes whose values compare equal to anything, passed them. Now a builder
call with literal arguments is an input of a probe (built in the sandbox by the program's helper, as natively), and
``is_same_*(<probe>, <builder>(<literals>))`` is decided in the parent: the sandbox sends the returned structure
back in a plain form, the expected one is built here with the prompt's steps, and the helper's comparison is
repeated on plain data (see ``trl_diffusion/rewards/verdict.py``). Every test below checks that the tests are
verified, that honest programs get the verdicts a native run gives them, and that the forgeries score 0.0.

Also here: a LeetCode method named like a method of plain values (``Solution().count(0)``) is the program's method,
so the correct solution passes (it used to fail: ``.count`` was taken for ``list.count``, run in the parent).
"""

import random

import pytest
from code_verdicts import fenced, native_outcomes, run_verified

from trl_diffusion.eval import problems_from_rows, score_completions
from trl_diffusion.rewards import build_tests, make_code_reward
from trl_diffusion.rewards.dllm_rl_code import make_official_code_reward
from trl_diffusion.rewards.sandbox import SandboxLimits, _make_encoder
from trl_diffusion.rewards.verdict import ProbeError, decode, judge, plan_test

LIMITS = SandboxLimits(timeout=10.0, memory_mb=256)

# The helpers of LeetCodeDataset's prompts (its exact text), after an import header like the dataset's.
HELPERS = """
class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next

def list_node(values: list):
    if not values:
        return None
    head = ListNode(values[0])
    p = head
    for val in values[1:]:
        node = ListNode(val)
        p.next = node
        p = node
    return head

def is_same_list(p1, p2):
    if p1 is None and p2 is None:
        return True
    if not p1 or not p2:
        return False
    return p1.val == p2.val and is_same_list(p1.next, p2.next)

class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val = val
        self.left = left
        self.right = right

def tree_node(values: list):
    if not values:
        return None
    root = TreeNode(values[0])
    i = 1
    queue = deque()
    queue.append(root)
    while queue:
        node = queue.popleft()
        if i < len(values) and values[i] is not None:
            node.left = TreeNode(values[i])
            queue.append(node.left)
        i += 1
        if i < len(values) and values[i] is not None:
            node.right = TreeNode(values[i])
            queue.append(node.right)
        i += 1
    return root

def is_same_tree(p, q):
    if not p and not q:
        return True
    elif not p or not q:
        return False
    elif p.val != q.val:
        return False
    else:
        return is_same_tree(p.left, q.left) and is_same_tree(p.right, q.right)
"""
PROMPT = "import collections\nfrom typing import *\nfrom collections import *\n\ninf = float('inf')\n" + HELPERS

REVERSE_CHECK = """def check(candidate):
    assert is_same_list(candidate(head = list_node([1,2,3,4,5])), list_node([5,4,3,2,1]))
    assert is_same_list(candidate(head = list_node([1,2])), list_node([2,1]))
    assert is_same_list(candidate(head = list_node([])), list_node([]))
"""
INVERT_CHECK = """def check(candidate):
    assert is_same_tree(candidate(root = tree_node([4,2,7,1,3,6,9])), tree_node([4,7,2,9,6,3,1]))
    assert is_same_tree(candidate(root = tree_node([1,2])), tree_node([1,None,2]))
    assert is_same_tree(candidate(root = tree_node([])), tree_node([]))
    assert candidate(root = tree_node([])) is None
"""
DEPTH_CHECK = """def check(candidate):
    assert candidate(root = tree_node([3,9,20,None,None,15,7])) == 3
    assert candidate(root = tree_node([1,None,2])) == 2
    assert candidate(root = tree_node([])) == 0
"""
VALUES_CHECK = """def check(candidate):
    assert candidate(head = list_node([1,2,3])) == [1,2,3]
    assert candidate(head = list_node([])) == []
"""
CHECKS = {
    "Solution().reverseList": REVERSE_CHECK,
    "Solution().invertTree": INVERT_CHECK,
    "Solution().maxDepth": DEPTH_CHECK,
    "Solution().values": VALUES_CHECK,
}
PLAIN = [
    "assert is_same_list(Solution().reverseList(list_node([1,2,3])), list_node([3,2,1]))",
    "assert is_same_list(list_node([2,1]), Solution().reverseList(head=list_node([1,2])))",
    "assert is_same_list(Solution().reverseList(list_node([])), list_node([]))",
    "assert is_same_tree(Solution().invertTree(tree_node([2,1,3])), tree_node([2,3,1]))",
    "assert is_same_tree(tree_node([1,None,2]), Solution().invertTree(tree_node([1,2])))",
    "assert is_same_tree(Solution().invertTree(tree_node([5,3,8,1,None,None,9])), tree_node([5,8,3,9,None,None,1]))",
    "assert Solution().invertTree(tree_node([])) is None",
    "assert Solution().maxDepth(tree_node([3,9,20,None,None,15,7])) == 3",
    "assert Solution().maxDepth(root=tree_node([1,2,None,3])) == 3",
    "assert Solution().values(list_node([4,5])) == [4, 5]",
]

CORRECT = """
class Solution:
    def reverseList(self, head):
        prev = None
        while head:
            head.next, prev, head = prev, head, head.next
        return prev

    def invertTree(self, root):
        if root:
            root.left, root.right = self.invertTree(root.right), self.invertTree(root.left)
        return root

    def maxDepth(self, root):
        return 1 + max(self.maxDepth(root.left), self.maxDepth(root.right)) if root else 0

    def values(self, head):
        out = []
        while head:
            out.append(head.val)
            head = head.next
        return out
"""


def _variant(**bodies):
    """``CORRECT`` with some methods replaced: a subclass of its Solution, defined under the same name."""
    methods = "".join(f"\n    def {name}(self, *args, **kwargs):\n{body}\n" for name, body in bodies.items())
    return CORRECT + "\n_Correct = Solution\n\nclass Solution(_Correct):" + methods


def _indent(code):
    return "\n".join("        " + line for line in code.strip().splitlines())


# Wrong answers: each fails some of the tests, natively and here.
WRONG = {
    "list_wrong_value": _variant(reverseList=_indent("""
head = _Correct().reverseList(*args, **kwargs)
if head:
    head.val += 1
return head
""")),
    "list_missing_node": _variant(reverseList=_indent("""
head = _Correct().reverseList(*args, **kwargs)
return head.next if head else head
""")),
    "list_extra_node": _variant(reverseList=_indent("""
return ListNode(0, _Correct().reverseList(*args, **kwargs))
""")),
    "list_unchanged": _variant(reverseList=_indent("""
return (list(args) + list(kwargs.values()))[0]
""")),
    "tree_unchanged": _variant(invertTree=_indent("""
return (list(args) + list(kwargs.values()))[0]
""")),  # tree_node([1, 2]) vs tree_node([1, None, 2]): the same values in level order, a left vs a right child
    "tree_root_only": _variant(invertTree=_indent("""
root = (list(args) + list(kwargs.values()))[0]
if root:
    root.left, root.right = root.right, root.left
return root
""")),
    "tree_wrong_value": _variant(invertTree=_indent("""
root = _Correct().invertTree(*args, **kwargs)
if root:
    root.val = -root.val
return root
""")),
    "tree_missing_node": _variant(invertTree=_indent("""
root = _Correct().invertTree(*args, **kwargs)
if root:
    root.right = None
return root
""")),
    "tree_extra_node": _variant(invertTree=_indent("""
root = _Correct().invertTree(*args, **kwargs)
node = root
while node and node.left:
    node = node.left
if node:
    node.left = TreeNode(0)
return root
""")),
    "depth_off_by_one": _variant(maxDepth=_indent("return _Correct().maxDepth(*args, **kwargs) + 1")),
    "values_reversed": _variant(values=_indent("return _Correct().values(*args, **kwargs)[::-1]")),
}

# Native semantics of the prompt's helpers that the plain forms keep.
FALSY = """
class FalsyTree(TreeNode):
    def __bool__(self):
        return False

class FalsyList(ListNode):
    def __bool__(self):
        return False

def _fill(root):  # every missing child of a tree becomes a falsy node, which is_same_tree takes for a missing one
    if root:
        root.left = _fill(root.left) or FalsyTree(-1)
        root.right = _fill(root.right) or FalsyTree(-1)
    return root
"""
SEMANTICS = {
    # is_same_tree: `not p` makes a falsy node a missing one (its value and children are never read): passes.
    "tree_falsy_children": FALSY
    + _variant(invertTree=_indent("return _fill(_Correct().invertTree(*args, **kwargs))")),
    # is_same_list: `p1 is None` first, then `not p1`: a falsy node never matches, not even where None is expected.
    "list_falsy_end": FALSY + _variant(reverseList=_indent("""
head = _Correct().reverseList(*args, **kwargs)
if head is None:
    return FalsyList(0)
node = head
while node.next:
    node = node.next
node.next = FalsyList(0)
return head
""")),
    "list_falsy_head": FALSY + _variant(reverseList=_indent("""
head = _Correct().reverseList(*args, **kwargs)
return FalsyList(head.val, head.next) if head else head
""")),
    # A node whose value is None is a node, not a missing child.
    "tree_none_valued_leaf": _variant(invertTree=_indent("""
root = _Correct().invertTree(*args, **kwargs)
if root and root.left is None:
    root.left = TreeNode(None)
return root
""")),
    # Values compare with ==: 2.0 == 2 and True == 1.
    "numbers_of_other_types": _variant(
        reverseList=_indent("""
head = _Correct().reverseList(*args, **kwargs)
node = head
while node:
    node.val = float(node.val) if node.val != 1 else True
    node = node.next
return head
"""),
        invertTree=_indent("""
root = _Correct().invertTree(*args, **kwargs)
if root:
    root.val = float(root.val)
return root
"""),
    ),
    "numpy_values": "import numpy as np\n" + _variant(reverseList=_indent("""
head = _Correct().reverseList(*args, **kwargs)
node = head
while node:
    node.val = np.int64(node.val)
    node = node.next
return head
""")),
    "returns_a_plain_list": _variant(reverseList=_indent("return [5, 4, 3, 2, 1]")),
    "returns_none": _variant(reverseList=_indent("return None"), invertTree=_indent("return None")),
}

ALWAYS_EQUAL = """
class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
"""
FORGERIES = {
    # Values that compare equal to anything, in the right structure (only the values are forged).
    "always_equal_values": ALWAYS_EQUAL + _variant(
        reverseList=_indent("""
head = _Correct().reverseList(*args, **kwargs)
node = head
while node:
    node.val = AlwaysEqual()
    node = node.next
return head
"""),
        invertTree=_indent("""
root = _Correct().invertTree(*args, **kwargs)
stack = [root]
while stack:
    node = stack.pop()
    if node:
        node.val = AlwaysEqual()
        stack += [node.left, node.right]
return root
"""),
    ),
    # A ListNode subclass whose __eq__ always answers True, each node its own value.
    "list_node_subclass_eq": """
class Forged(ListNode):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
"""
    + _variant(reverseList=_indent("""
head = (list(args) + list(kwargs.values()))[0]
forged = None
while head:
    forged = Forged(None, forged)
    forged.val = forged
    head = head.next
return forged
""")),
    # A class of its own with __eq__ always True and the duck-typed attributes of a tree node.
    "custom_tree_class_eq": """
class Forged:
    def __init__(self, left, right):
        self.val, self.left, self.right = self, left, right
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__

def _forge(root):
    return Forged(_forge(root.right), _forge(root.left)) if root else None
"""
    + _variant(invertTree=_indent("return _forge((list(args) + list(kwargs.values()))[0])")),
    "patched_helpers_at_import": _variant(reverseList=_indent("return None"), invertTree=_indent("return None"))
    + "\nis_same_list = lambda p1, p2: True\nis_same_tree = lambda p, q: True\n",
    # The first call answers right and patches the comparison for the asserts after it.
    "patched_helpers_in_method": _variant(
        reverseList=_indent("""
if globals().get("patched"):
    return None
globals().update(patched=True, is_same_list=lambda p1, p2: True, is_same_tree=lambda p, q: True)
return _Correct().reverseList(*args, **kwargs)
"""),
        invertTree=_indent("""
if globals().get("patched"):
    return None
globals().update(patched=True, is_same_list=lambda p1, p2: True, is_same_tree=lambda p, q: True)
return _Correct().invertTree(*args, **kwargs)
"""),
    ),
    # Builders that make nothing: natively the expected side becomes None, and so is the answer.
    "patched_builders": _variant(reverseList=_indent("return None"), invertTree=_indent("return None"))
    + "\ndef list_node(values):\n    return None\n\ndef tree_node(values):\n    return None\n",
    "patched_builtins": _variant(reverseList=_indent("return None"), invertTree=_indent("return None"))
    + """
import builtins
builtins.is_same_list = lambda p1, p2: True
builtins.is_same_tree = lambda p, q: True
del is_same_list, is_same_tree
builtins.getattr = lambda *args: 0
builtins.id = lambda obj: 0
""",
    "init_replaces_check": _variant(reverseList=_indent("return None"), invertTree=_indent("return None"))
    + """
def _init(self):
    check = globals().get("check")
    if check is not None:
        check.__code__ = (lambda candidate: None).__code__

Solution.__init__ = _init
""",
    "cyclic_list": _variant(reverseList=_indent("""
head = _Correct().reverseList(*args, **kwargs)
node = head
while node and node.next:
    node = node.next
if node:
    node.next = head
return head
""")),
    "cyclic_tree": _variant(invertTree=_indent("""
root = _Correct().invertTree(*args, **kwargs)
if root:
    root.left = root
return root
""")),
    # A falsy node where the expected structure has a node (its value and children are right).
    "falsy_node_where_a_node_is_expected": FALSY
    + _variant(
        reverseList=_indent("""
head = _Correct().reverseList(*args, **kwargs)
return FalsyList(head.val, head.next) if head else FalsyList(0)
"""),
        invertTree=_indent("""
root = _Correct().invertTree(*args, **kwargs)
return FalsyTree(root.val, root.left, root.right) if root else FalsyTree(0)
"""),
    ),
    "raising_val_property": """
class Raising(TreeNode, ListNode):
    @property
    def val(self):
        raise ValueError("no value")
    @val.setter
    def val(self, value):
        pass
"""
    + _variant(
        reverseList=_indent("return Raising()"),
        invertTree=_indent("return Raising()"),
    ),
    # Right on the first call, forged values afterwards (a class attribute switches).
    "class_attribute_switches": ALWAYS_EQUAL + _variant(reverseList=_indent("""
if Solution.answered:
    head, n = (list(args) + list(kwargs.values()))[0], 0
    while head:
        head, n = head.next, n + 1
    return list_node([AlwaysEqual()] * n)
Solution.answered = True
return _Correct().reverseList(*args, **kwargs)
""")) + "\nSolution.answered = False\n",
}
# The forgeries that pass natively (run the way the unverified mode ran these tests) without solving the task.
ACTING = {
    "always_equal_values",
    "list_node_subclass_eq",
    "custom_tree_class_eq",
    "patched_helpers_at_import",
    "patched_helpers_in_method",
    "patched_builders",
    "patched_builtins",
    "init_replaces_check",
    "class_attribute_switches",
}


def _tests(entry):
    return build_tests(test=CHECKS[entry], entry_point=entry)


def _forged(code):
    """The entry points whose method a forgery replaces (``_variant`` defines them)."""
    entries = ("Solution().reverseList", "Solution().invertTree")
    return [entry for entry in entries if f"def {entry.split('.')[1]}(self, *args" in code]


ALL_CHECKS = [test for entry in CHECKS for test in _tests(entry)]
STRUCTURE_TESTS = _tests("Solution().reverseList") + _tests("Solution().invertTree") + PLAIN[:7]


def _run(code, tests):
    """``code`` after the prompt, every test decided outside the sandbox and the sandbox run ending normally."""
    result = run_verified(PROMPT + code, tests, LIMITS)
    assert result.status == "ok", (result.errors, result.output)
    return result


def _native(code, tests, tmp_path):
    """The native verdicts (``native_outcomes``) of ``code`` after the prompt."""
    return native_outcomes(PROMPT + code, tests, tmp_path)


# ------------------------------------------------------------------------------------------------------- planning


def test_structure_tests_are_planned_verified_without_their_expected_values():
    [snippet] = _tests("Solution().reverseList")
    plan = plan_test(snippet)
    assert plan.kind == "verified", plan.reason
    assert plan.probes == (
        "candidate(head=list_node([1, 2, 3, 4, 5]))",
        "candidate(head=list_node([1, 2]))",
        "candidate(head=list_node([]))",
    )
    assert plan.shapes == ("list", "list", "list")
    assert plan.has == ("list_node", "is_same_list")
    spec = repr(plan.sandbox_spec())
    assert "5, 4" not in spec and "[2, 1]" not in spec  # the expected structures stay in the parent
    [snippet] = _tests("Solution().invertTree")
    plan = plan_test(snippet)
    assert plan.kind == "verified" and plan.shapes == ("tree", "tree", "tree", ""), plan.reason
    assert "4, 7, 2" not in repr(plan.sandbox_spec()) and "None, 2" not in repr(plan.sandbox_spec())
    for entry in ("Solution().maxDepth", "Solution().values"):
        [snippet] = _tests(entry)
        plan = plan_test(snippet)
        assert plan.kind == "verified" and set(plan.shapes) == {""} and plan.has == (), plan.reason
    for test in PLAIN:
        assert plan_test(test).kind == "verified", test
    # The expected side may come first; the probe is the other argument.
    plan = plan_test(PLAIN[1])
    assert plan.probes == ("Solution().reverseList(head=list_node([1, 2]))",) and plan.shapes == ("list",)


def test_other_uses_of_the_helpers_stay_unverified():
    """Only the shapes above decompose: a builder on the expected side of ``==`` (the program's builder would make
    it in the sandbox), a comparison given anything but a probe and the matching builder of literals, and names the
    test binds itself (they are not the prompt's helpers)."""
    kinds = {
        "assert f(list_node([1, 2])) == [2, 1]": "verified",
        "assert f(tree_node([1, None, 2])) is None": "verified",
        "assert is_same_tree(f(1), g(2))": "verified",  # two probes, both sent back as trees
        "assert is_same_list(list_node([1]), list_node([1]))": "verified",  # decided here alone
        "assert not is_same_list(f(list_node([1])), list_node([1]))": "verified",
        "assert f(list_node([1, 2])) == list_node([2, 1])": "unverified",
        "assert is_same_list(f(1), list_node([1])) == list_node([1])": "unverified",
        "assert list_node([1]).val == f(1)": "unverified",
        "assert is_same_list(f(1), None)": "unverified",
        "assert is_same_list(f(1), tree_node([1]))": "unverified",
        "assert is_same_list(p1=f(1), p2=list_node([1]))": "unverified",
        "assert is_same_list(f(1), list_node(list(range(3))))": "unverified",
        "assert is_same_list(f(1), list_node(x))": "unverified",
        "assert is_same_list(f(list_node(x)), list_node([1]))": "unverified",
        "assert f(1) or is_same_list(f(2), list_node([1]))": "unverified",  # f(2) runs only if f(1) is falsy
        "assert is_same_list(f(1), list_node([1]), 3)": "unverified",
        "from helpers import list_node\nassert is_same_list(f(1), list_node([1]))": "unverified",
        "from helpers import is_same_list\nassert is_same_list(f(1), list_node([1]))": "unverified",
        "def list_node(v):\n    return v\n\nassert is_same_list(f(1), list_node([1]))": "unverified",
    }
    assert {test: plan_test(test).kind for test in kinds} == kinds
    # check()'s parameter is the function under test even when it is named like a helper: its calls are probes.
    plan = plan_test("def check(list_node):\n    assert is_same_list(list_node(1), list_node([1]))\n\ncheck(f)")
    assert (plan.kind, plan.probes, plan.shapes) == ("verified", ("list_node(1)", "list_node([1])"), ("list", "list"))


def test_the_expected_structure_is_built_here_by_the_prompts_steps():
    """``judge`` with forged probe values: the parent builds ``list_node`` / ``tree_node`` itself and compares with the
    helpers' semantics; a malformed form (only a program writing its own report sends one) fails."""
    plan = plan_test("assert is_same_tree(f(1), tree_node([3, 9, 20, None, None, 15, 7]))")
    assert judge(plan, [("11100110000", [3, 9, 20, 15, 7])]) is None
    assert judge(plan, [("11100110000", [3, 9, 20, 15, 8])]) is not None
    assert judge(plan, [("11010110000", [3, 9, 20, 15, 7])]) is not None  # 20 a left child of 9
    assert judge(plan, [("0", [])]) is not None
    assert judge(plan, [ProbeError("ValueError: no value")]) == "ValueError: no value"
    for malformed in (("1110011000", [3, 9, 20, 15]), ("11100110000", [3, 9, 20, 15, 7, 1]), "x", ([3], False)):
        assert judge(plan, [malformed]) is not None
    # tree_node skips what its queue never reaches, and a None first value is a node.
    assert judge(plan_test("assert is_same_tree(f(1), tree_node([1, None, None, 5]))"), [("100", [1])]) is None
    assert judge(plan_test("assert is_same_tree(f(1), tree_node([None]))"), [("100", [None])]) is None
    assert judge(plan_test("assert is_same_tree(f(1), tree_node([]))"), [("0", [])]) is None
    plan = plan_test("assert is_same_list(f(1), list_node([1, 2]))")
    assert judge(plan, [([1, 2], False)]) is None
    for wrong in (([1, 2], True), ([1], False), ([1, 2, 3], False), ([2, 1], False), ([], False)):
        assert judge(plan, [wrong]) is not None
    assert judge(plan_test("assert is_same_list(f(1), list_node([]))"), [([], False)]) is None
    assert judge(plan_test("assert is_same_list(f(1), list_node([]))"), [([], True)]) is not None
    assert judge(plan_test("assert is_same_list(f(1), list_node('ab'))"), [(["a", "b"], False)]) is None
    assert judge(plan_test("assert is_same_list(f(1), list_node(3))"), [([], False)]).startswith("TypeError")


def test_plain_forms_agree_with_the_helpers_on_random_structures():
    """The sandbox's walk (``encode(value, "list" / "tree")``) and the parent's builders and comparisons give, for
    random structures built by the prompt's own helpers (some of whose nodes are then made falsy), the verdict the
    prompt's ``is_same_list`` / ``is_same_tree`` give natively."""
    encode, _ = _make_encoder()
    helpers = {}
    exec("from collections import deque\n" + HELPERS + FALSY, helpers)
    rng = random.Random(0)
    pool = [None, None, 0, 1, 2, 1.0, True, "a", (1,)]

    def values():
        return [rng.choice(pool) for _ in range(rng.randrange(8))]

    def make_falsy(node, falsy_class):
        while node is not None:
            if rng.random() < 0.1:
                node.__class__ = falsy_class
            node = getattr(node, "next", None) or (getattr(node, "left", None) or getattr(node, "right", None))

    for kind, build, same, falsy in (
        ("list", "list_node", "is_same_list", "FalsyList"),
        ("tree", "tree_node", "is_same_tree", "FalsyTree"),
    ):
        agreed = set()
        for _ in range(400):
            answer, expected = values(), values()
            if rng.random() < 0.3:
                expected = list(answer)
            probe = helpers[build](answer)
            make_falsy(probe, helpers[falsy])
            native = helpers[same](probe, helpers[build](expected))
            plan = plan_test(f"assert {same}(f(1), {build}({expected!r}))")
            assert plan.shapes == (kind,)
            verdict = judge(plan, [decode(encode(probe, kind))])
            assert (verdict is None) == native, (kind, answer, expected)
            agreed.add(native)
        assert agreed == {True, False}  # both verdicts occur


# ------------------------------------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize("shape", ["check", "plain"])
def test_correct_solutions_pass_and_wrong_ones_fail(shape):
    tests = ALL_CHECKS if shape == "check" else PLAIN
    assert _run(CORRECT, tests).all_passed
    for name, code in WRONG.items():
        assert not _run(code, tests).all_passed, name
    reward = make_code_reward(timeout=10.0, memory_mb=256, allow_unverified=False)
    column = {"test": [CHECKS["Solution().reverseList"]] * 2, "entry_point": ["Solution().reverseList"] * 2}
    if shape == "plain":
        column = {"tests": [PLAIN] * 2}
    # allow_unverified=False scores these rows instead of leaving them out.
    wrong = WRONG["list_missing_node"]
    assert reward([fenced(PROMPT + CORRECT), fenced(PROMPT + wrong)], **column) == [1.0, 0.0]


def test_verdicts_equal_native_execution(tmp_path):
    """The differential check: for honest programs (right, wrong, and the helpers' edge cases), every test's verdict
    is the one running the prompt, the program and the test natively gives."""
    tests = ALL_CHECKS + PLAIN
    for name, code in {"correct": CORRECT, **WRONG, **SEMANTICS}.items():
        native = _native(code, tests, tmp_path)
        assert _run(code, tests).outcomes == native, name
        if name != "correct" and name not in ("tree_falsy_children", "numbers_of_other_types", "numpy_values"):
            assert not all(native), name  # each wrong program really fails something
    # The edge cases really are what they claim: a falsy tree node is a missing child (passes) ...
    assert all(_native(SEMANTICS["tree_falsy_children"], tests, tmp_path))
    # ... and a falsy list node never matches, even where None is expected.
    falsy_end = _run(SEMANTICS["list_falsy_end"], _tests("Solution().reverseList") + PLAIN[:3]).outcomes
    assert falsy_end == [False, False, False, False]


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgeries_score_zero(name):
    code = FORGERIES[name]
    reward = make_code_reward(timeout=10.0, memory_mb=256)
    for entry in _forged(code):
        assert reward([fenced(PROMPT + code)], test=[CHECKS[entry]], entry_point=[entry]) == [0.0], entry
    assert reward([fenced(PROMPT + code)], tests=[PLAIN[:7]]) == [0.0]
    result = _run(code, STRUCTURE_TESTS)
    assert not result.all_passed


def test_the_forgeries_really_act(tmp_path):
    """Run the way the unverified mode ran these tests (in the program's namespace), the acting forgeries pass every
    structure test, or every check, without solving the task; here they fail."""
    entries = ["Solution().reverseList", "Solution().invertTree"]
    checks = [test for entry in entries for test in _tests(entry)]
    for name in sorted(ACTING):
        assert _native(FORGERIES[name], checks, tmp_path) == [True, True], name
        forged = _forged(FORGERIES[name])
        assert _run(FORGERIES[name], checks).outcomes == [entry not in forged for entry in entries], name


def test_honest_encoding_ignores_patched_builtins():
    """The sandbox walks a returned structure with functions bound before the program ran: a right answer still
    passes when the program has replaced ``getattr``, ``id``, ``isinstance`` and ``bool`` in builtins."""
    patched = CORRECT + (
        "\nimport builtins\nbuiltins.getattr = lambda *args: 0\nbuiltins.id = lambda obj: 0\n"
        "builtins.isinstance = lambda *args: False\nbuiltins.bool = lambda obj=False: False\n"
    )
    assert _run(patched, STRUCTURE_TESTS).all_passed


def test_long_lists_and_deep_trees(tmp_path):
    """The plain forms are flat: a tree far deeper than the probe values' nesting limit (100) is compared, and the
    comparison does not recurse. Natively ``is_same_list`` recurses once per node, so a right answer of 3000 nodes
    raises RecursionError there; here it passes (a documented difference). A cyclic tree runs into the sandbox's
    node budget and fails."""
    n = 300
    right_skewed = [1] + [v for i in range(2, n + 1) for v in (None, i)]
    left_skewed = [1] + [v for i in range(2, n + 1) for v in (i, None)]
    deep = [f"assert is_same_tree(Solution().invertTree(tree_node({right_skewed})), tree_node({left_skewed}))"]
    deep.append(f"assert Solution().maxDepth(tree_node({left_skewed})) == {n}")
    assert _run(CORRECT, deep).outcomes == [True, True] == _native(CORRECT, deep, tmp_path)
    values = list(range(3000))
    long = [f"assert is_same_list(Solution().reverseList(list_node({values})), list_node({values[::-1]}))"]
    assert _run(CORRECT, long).outcomes == [True]
    assert _native(CORRECT, long, tmp_path) == [False]  # RecursionError in is_same_list
    assert _run(FORGERIES["cyclic_tree"], _tests("Solution().invertTree")).outcomes == [False]


# ------------------------------------------------------------------------------------------ methods named like str's

COUNTING = """
class Solution:
    def count(self, nums, x):
        return sum(1 for n in nums if n == x)

    def index(self, s, ch):
        return s.find(ch)

    def split(self, s):
        return s.split(",")
"""
COUNTING_TESTS = [
    "assert Solution().count([0, 1, 0, 0], 0) == 3",
    "assert Solution().count(nums=[], x=1) == 0",
    "assert Solution().index('abc', 'c') == 2",
    "assert Solution().split('a,b').count('a') == 1",  # .count of the returned list: runs here
    "assert Solution().split('a,b') == ['a', 'b']",
    *build_tests(test="def check(candidate):\n    assert candidate([1, 1], 1) == 2\n", entry_point="Solution().count"),
]


def test_methods_named_like_methods_of_plain_values(tmp_path):
    """``Solution().count(0)`` is the program's method (a fresh instance of a program class): a probe, verified; a
    method of plain values called on a *returned* value still runs here, on the plain value."""
    assert plan_test("assert Solution().count(0) == 3").probes == ("Solution().count(0)",)
    assert plan_test("assert Solution().split('a,b').count('a') == 1").probes == ("Solution().split('a,b')",)
    assert plan_test("assert f(2).count(1) == 2").probes == ("f(2)",)
    assert plan_test("assert Solution().__len__() == 2").kind == "unverified"  # a dunder: not the method under test
    split = "def check(candidate):\n    assert candidate('a b').split() == ['a', 'b']\n"
    [check] = build_tests(test=split, entry_point="f")
    assert plan_test(check).probes == ("candidate('a b')",)
    assert _run(COUNTING, COUNTING_TESTS).outcomes == [True] * 6 == _native(COUNTING, COUNTING_TESTS, tmp_path)
    wrong = COUNTING.replace("return sum(1 for n in nums if n == x)", "return 0")
    assert _run(wrong, COUNTING_TESTS).outcomes == [False, True, True, True, True, False]
    assert _native(wrong, COUNTING_TESTS, tmp_path) == [False, True, True, True, True, False]
    reward = make_code_reward(timeout=10.0, memory_mb=256, allow_unverified=False)
    assert reward([fenced(COUNTING), fenced(wrong)], tests=[COUNTING_TESTS] * 2) == [1.0, 0.0]


# ------------------------------------------------------------------------------------------------- graders, rows

ROW = {
    "task_id": "reverse-linked-list",
    "prompt": PROMPT,
    "test": REVERSE_CHECK,
    "entry_point": "Solution().reverseList",
}


@pytest.mark.parametrize("grader", ["sandbox", "official"])
def test_eval_graders_decide_structure_rows_outside(grader):
    """A LeetCodeDataset-style row: the prompt goes before the completion, its check is verified."""
    problems = problems_from_rows([ROW])
    programs = [CORRECT, WRONG["list_extra_node"], FORGERIES["always_equal_values"], FORGERIES["patched_builders"]]
    completions = [fenced(p) for p in programs]
    results = score_completions(problems * len(programs), completions, limits=LIMITS, code_grader=grader)
    assert [r["reward"] for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert [r["tests_verified"] for r in results] == [1] * len(programs)


def test_official_code_reward_scores_structure_rows():
    """dLLM-RL's reward with ``allow_unverified=False`` scores these rows (they used to get ``None``)."""
    strict = make_official_code_reward(memory_mb=256, allow_unverified=False)
    completions = [fenced(PROMPT + CORRECT), fenced(PROMPT + FORGERIES["patched_helpers_at_import"])]
    tests = PLAIN[:2] + PLAIN[3:6]  # the forgery's None would be right for an empty list or tree
    assert strict(completions, test_method=["function"] * 2, test_list=[tests] * 2) == [5.0, 0.0]
