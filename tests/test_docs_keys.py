"""Every config key README.md and docs/*.md name in backticks exists today.

A key is `section.key` or `section.sub.key` for a section of `Config` (grpo_run/config/schema.py), with
`=value`, a leading `+` and list indices (`reward.functions[i].model.path`, `reward.functions.0.weight`)
allowed. It exists when it resolves in the composed default config (conf/config.yaml) or in the config
composed with one group option (e.g. `reward=judge` gives `reward.functions[i].model`); below a
dict-valued field (`env.kwargs`, `eval.datasets`) or a field typed Any (`eval.reward`, a word or a list
checked by grpo_run/config/checks/) any name is a key; `grpo.trust_region_*` stands for the keys it starts.
A span that names code (`trainer.after_step`, `rollout.groups.sample_groups`) is a code reference, not a
key: it passes when that module of grpo_run/ defines that name.
"""

import ast
import dataclasses
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_run.cli import CONF_DIR
from grpo_run.config.schema import Config
from tests.helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SECTIONS = [f.name for f in dataclasses.fields(Config)]

# Keys a doc names only to say they do not exist: each must stay absent, so what the doc says stays true.
NAMED_AS_ABSENT = {
    # docs/configuration.md's example of a typo Hydra rejects with "did you mean grpo.beta".
    "grpo.betta",
    # TRL's GRPOConfig names given under our sections: docs/configuration.md says they exit 2 naming our
    # key (trainer.lr, grpo.group_size, aggregation=...; grpo_run/config/trl_names.py).
    "trainer.learning_rate",
    "grpo.num_generations",
    "grpo.loss_type",
    # Removed with distill.form=loss (docs/algorithm.md, docs/configuration.md): a config naming it exits 2
    # naming what replaced it.
    "distill.kl_estimator",
}

_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_SECTION = "|".join(SECTIONS)
_KEY = re.compile(r"(?<![\w./${-])\+{0,2}((?:" + _SECTION + r")(?:\.\w+|\[\w+\])+\*?)")
# A file name that starts like a section (`model.safetensors`, `trainer.py`) is no key.
_FILE = re.compile(r"\.(py|md|json|jsonl|yaml|safetensors|png|txt|gz|bin)$")


def named_keys(text: str) -> set[str]:
    """The config keys named in inline code spans (fenced blocks are commands and code, checked elsewhere)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    keys = set()
    for span in _SPAN.findall(text):
        keys |= {key for key in _KEY.findall(span) if not _FILE.search(key)}
    return keys


def parts(key: str) -> list[str]:
    return [p for p in re.split(r"[.\[\]]+", key) if p]


def resolves(node, path: list[str]) -> bool:
    for i, part in enumerate(path):
        if isinstance(node, ListConfig):
            if not (part.isdigit() or len(part) == 1):  # [0], .0 or a placeholder such as [i]
                return False
            if len(node) == 0:
                return False
            node = node._get_node(0)
        elif isinstance(node, DictConfig):
            if node._is_none() or node._is_missing():
                return False
            keys = list(node.keys())  # `in node` is False for a ??? value
            if part.endswith("*"):
                return i == len(path) - 1 and any(k.startswith(part[:-1]) for k in keys)
            if part in keys:
                node = node._get_node(part)
            elif OmegaConf.get_type(node) is dict:  # a dict-valued field: its keys are the user's
                return True
            else:
                return False
        else:  # a value: only a field typed Any (a word or a list, checked at the door) goes deeper
            return node._metadata.ref_type is Any
    return True


@cache
def configs() -> list[DictConfig]:
    """The default config and the config with each group option chosen."""
    overrides = [[]]
    for group in sorted(p for p in Path(CONF_DIR).iterdir() if p.is_dir() and p.name != "hydra"):
        overrides += [[f"{group.name}={option.stem}"] for option in sorted(group.glob("*.yaml"))]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return [compose(config_name="config", overrides=o) for o in overrides]


def exists(key: str) -> bool:
    return any(resolves(cfg, parts(key)) for cfg in configs())


@cache
def defined_names(module: Path) -> frozenset[str]:
    tree = ast.parse(module.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
    return frozenset(names)


def names_code(key: str) -> bool:
    """`module.name` or `package.module.name` naming something a module of grpo_run/ defines."""
    path = parts(key)
    package = REPO / "grpo_run"
    for depth in (1, 2):
        if len(path) != depth + 1:
            continue
        *modules, name = path
        for base in [package, *package.rglob("*/")]:
            stem = base.joinpath(*modules)
            for module in (stem.with_suffix(".py"), stem / "__init__.py"):
                if module.is_file() and name in defined_names(module):
                    return True
    return False


def test_the_extraction_finds_keys_and_passes_over_file_names():
    text = "Set `grpo.beta=0.04`, `+env._target_=my.Env` and `reward.functions[i].model.path`; see `model.safetensors`."
    assert named_keys(text) == {"grpo.beta", "env._target_", "reward.functions[i].model.path"}
    assert named_keys("```bash\ngrpo-run `trainer.nothing`\n```\n") == set()


def test_resolving_follows_groups_lists_and_dict_fields():
    assert exists("grpo.beta") and exists("reward.functions[i].model.path") and exists("env.kwargs.anything")
    assert exists("reward.functions.0.weight") and exists("eval.datasets.gsm8k")
    assert (
        exists("grpo.trust_region_*") and exists("eval.reward[i]._target_") and exists("distill.teacher.path")
    )
    assert not exists("rollout.lend_threads") and not exists("rollout.eval_on") and not exists("grpo.bet")
    assert not exists("grpo.beta.x") and not exists("model.device")


def test_a_code_reference_must_name_what_the_module_defines():
    assert names_code("trainer.after_step") and names_code("rollout.groups.sample_groups")
    assert names_code("checkpoint.TrainerState")
    assert not names_code("trainer.no_such_function") and not names_code("rollout.groups.no_such_name")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_key_a_doc_names_exists(doc):
    keys = named_keys(doc.read_text())
    missing = sorted(k for k in keys - NAMED_AS_ABSENT if not exists(k) and not names_code(k))
    assert not missing, f"{doc.relative_to(REPO)} names keys no config has: {missing}"


def test_the_keys_named_as_absent_are_absent_and_still_named():
    named = set().union(*(named_keys(doc.read_text()) for doc in DOCS))
    assert NAMED_AS_ABSENT <= named, f"no doc names {sorted(NAMED_AS_ABSENT - named)} any more: drop it here"
    assert not any(exists(key) for key in NAMED_AS_ABSENT)
