"""docs/configuration.md's two tables are the ones generated from the schema and conf/."""

import os

from megand.tools import config_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "configuration.md")


def generated_section(marker: str) -> str:
    text = open(DOC).read()
    return text.split(f"<!-- {marker}:start -->\n", 1)[1].split(f"<!-- {marker}:end -->", 1)[0]


def test_config_reference_is_generated_from_the_schema():
    assert generated_section("config-reference") == config_reference.reference(), \
        "docs/configuration.md out of date: run python tools/config_reference.py --write"


def test_presets_table_lists_every_preset_of_conf():
    assert generated_section("presets") == config_reference.presets(), \
        "docs/configuration.md out of date: run python tools/config_reference.py --write"


def test_every_schema_key_is_in_the_reference():
    table = generated_section("config-reference")
    missing = [key for key in config_reference.keys() if f"| `{key}` |" not in table]
    assert not missing, f"keys of the schema missing from docs/configuration.md: {missing}"


def test_the_family_table_lists_the_registered_families():
    """docs/model-families.md's table has one row per registered Hugging Face family, with its class."""
    import re

    from megand.models.hf_families import FAMILIES

    text = open(os.path.join(ROOT, "docs", "model-families.md")).read()
    table = text.split("## What each family supports", 1)[1].split("\n\n| `model_type` |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)`", table, flags=re.M)
    assert rows == [(f.model_type, f.model_class) for f in FAMILIES.values()], \
        "docs/model-families.md's family table differs from megand/models/hf_families.py's FAMILIES"


def registries() -> dict:
    """Every registry a reader of the README or of docs/extending.md should find complete: kind -> names."""
    from megand.core.optimizer.registry import OPTIMIZERS
    from megand.core.pipeline_parallel.registry import schedule_names
    from megand.core.tensor_parallel.fp8_recipes import RECIPES
    from megand.data.source import DATA_KINDS
    from megand.models.hf_families import FAMILIES

    return {"schedules": schedule_names(), "families": tuple(FAMILIES), "optimizers": tuple(OPTIMIZERS),
            "data sources": tuple(DATA_KINDS), "precision recipes": tuple(RECIPES)}


def test_extending_lists_exactly_the_registered_records():
    """docs/extending.md's "Registered ...:" line of each kind names exactly what is registered."""
    import re

    text = open(os.path.join(ROOT, "docs", "extending.md")).read()
    for kind, names in registries().items():
        line = re.search(rf"^Registered {kind}: (.*?)\.$", text, flags=re.M | re.S)
        assert line, f"docs/extending.md has no 'Registered {kind}:' line"
        listed = set(re.findall(r"`(\w+)`", line.group(1)))
        assert listed == set(names), f"docs/extending.md lists {kind} {sorted(listed)}, registered: {sorted(names)}"


def test_readme_names_every_registered_record():
    """The README's intro and code map name every registered schedule, family, optimizer, data source and
    precision recipe."""
    import re

    text = open(os.path.join(ROOT, "README.md")).read()
    for kind, names in registries().items():
        missing = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
        assert not missing, f"README.md does not name the registered {kind} {missing}"
