"""One row per drafting method: a toy method added here is one ``Drafter`` class and one row of the
method table, and everything that lists, checks, routes or builds methods knows it from that row
alone: the method lists, the command line's help and its ``--method``, the bench's method names,
the option checks, the backend choice, the factory; and the engine keeps it lossless."""

import json
from pathlib import Path

import pytest
import torch

from forerun.build import method_backend, parse_method
from forerun.cli import build_parser, main
from forerun.drafters import (
    Draft,
    Drafter,
    DraftingMethod,
    head_methods,
    make_drafter,
    method_names,
    register_method,
    tree_methods,
    unregister_method,
)
from forerun.engine import Engine
from forerun.errors import ForerunError


class EchoDrafter(Drafter):
    """A toy: drafts the last token, repeated."""

    name = "echo"

    def propose(self, tokens: list[int], k: int) -> Draft:
        return Draft(tokens=torch.tensor([tokens[-1]] * k, dtype=torch.long))

    def fork(self) -> "EchoDrafter":
        return EchoDrafter()


@pytest.fixture
def echo():
    yield register_method(DraftingMethod("echo", "the last token, repeated", lambda request: EchoDrafter()))
    unregister_method("echo")


def _generate(capsys, folder, method):
    rc = main(["generate", "w5 w5 w5 w6", "--model", str(folder), "--method", method, "--k", "3",
               "--max-new-tokens", "12", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_a_toy_method_is_one_class_and_one_row(echo, gemma, tiny_folder, capsys):
    assert "echo" in method_names() and "echo" not in tree_methods() + head_methods()
    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    assert "echo" in helps["method"]
    assert parse_method("echo:3").kind == "echo" and parse_method("echo:auto").k == "auto"
    with pytest.raises(ForerunError, match="echo-tree"):
        parse_method("echo-tree")
    with pytest.raises(ForerunError, match="token trees .*not echo"):
        make_drafter("echo", gemma, tree=(4, None))
    with pytest.raises(ForerunError, match="adapt trains.*not echo"):
        make_drafter("echo", gemma, adapt=True)
    with pytest.raises(ForerunError, match="draft model.*not echo"):
        make_drafter("echo", gemma, draft_window=8)
    assert method_backend("echo", str(tiny_folder)) == method_backend("ngram", str(tiny_folder))

    prompt = [5, 5, 5, 6, 5, 5]
    plain = Engine(gemma.backend, None, ()).generate(prompt, max_new_tokens=16).token_ids
    res = Engine(gemma.backend, make_drafter("echo", gemma), ()).generate(prompt, max_new_tokens=16, k=3)
    assert res.token_ids == plain and res.stats.drafted > 0

    got = _generate(capsys, tiny_folder, "echo")
    assert got["method"] == "echo" and got["token_ids"] == _generate(capsys, tiny_folder, "none")["token_ids"]
    assert got["drafted"] > 0


def test_a_method_not_in_the_table_is_refused_everywhere(capsys, tiny_folder):
    assert "echo" not in method_names()
    with pytest.raises(ForerunError, match="unknown method 'echo'"):
        make_drafter("echo", None)
    with pytest.raises(ForerunError, match="unknown method 'echo'"):
        parse_method("echo:3")
    rc = main(["generate", "w5", "--model", str(tiny_folder), "--method", "echo"])
    assert rc != 0 and "unknown method 'echo'" in capsys.readouterr().err


def test_the_readme_lists_every_command_and_the_table_s_methods():
    """The README's command list is the parser's commands, and its --method list the table's rows."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme[readme.index("## Command line"):readme.index("## Library")]
    commands = build_parser()._subparsers._group_actions[0].choices
    assert {line.split()[1] for line in block.splitlines() if line.startswith("forerun ")} == set(commands)
    assert f"[--method {'|'.join(method_names())}]" in block
