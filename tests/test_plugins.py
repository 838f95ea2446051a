"""Plugin lookup (name, import path, class, instance, entry point) and domain validation.

Run: .venv/bin/pytest tests/test_plugins.py -q
"""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, Engine, EngineArgs, Entry,
                       MoeParallelConfig, OuterParallelConfig, ParallelConfig, register_plugin)
from phyai_ray.errors import ParallelConfigError, PluginError
from phyai_ray.plugins.registry import ENTRY_POINT_GROUP, registered_names, resolve_plugin
from tests.plugins.tiny import ProbeEntry, TinyRowTPEntry

# -- resolution ------------------------------------------------------------------------------------


def test_registered_name():
    entry = resolve_plugin("tiny_row_tp")
    assert type(entry) is TinyRowTPEntry
    assert "tiny_row_tp" in registered_names() and "test_probe" in registered_names()


def test_import_path():
    assert type(resolve_plugin("tests.plugins.tiny:ProbeEntry")) is ProbeEntry


def test_entry_class_and_instance():
    assert type(resolve_plugin(TinyRowTPEntry)) is TinyRowTPEntry
    instance = ProbeEntry()
    assert resolve_plugin(instance) is instance


class EpModuleFixture:
    """A tiny installed distribution: `<tmp>/<name>.dist-info` advertising a plugin module in <tmp>."""

    MODULE = "phyai_ep_probe_mod"

    def __init__(self, root) -> None:
        (root / f"{self.MODULE}.py").write_text(textwrap.dedent("""
            from phyai_ray import Entry

            class EpEntry(Entry):
                name = "ep_probe"
                parallel_domains = frozenset({"dense"})

                def create(self, plugin_args, ctx):
                    return None
        """))
        info = root / "phyai_ep_probe-0.1.dist-info"
        info.mkdir()
        info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: phyai-ep-probe\nVersion: 0.1\n")
        info.joinpath("entry_points.txt").write_text(
            f"[{ENTRY_POINT_GROUP}]\nep_probe = {self.MODULE}:EpEntry\nep_broken = {self.MODULE}:Missing\n")
        self.root = str(root)


@pytest.fixture
def installed_plugin_dist(tmp_path):
    dist = EpModuleFixture(tmp_path)
    sys.path.insert(0, dist.root)
    yield dist
    sys.path.remove(dist.root)
    sys.modules.pop(EpModuleFixture.MODULE, None)


def test_entry_point_group(installed_plugin_dist):
    assert {"ep_probe", "ep_broken"} <= set(registered_names())
    entry = resolve_plugin("ep_probe")
    assert type(entry).__name__ == "EpEntry" and type(entry).__module__ == EpModuleFixture.MODULE
    assert entry.parallel_domains == frozenset({"dense"})


def test_broken_entry_point_names_itself(installed_plugin_dist):
    with pytest.raises(PluginError, match=r"entry point 'ep_broken' = 'phyai_ep_probe_mod:Missing' failed to load"):
        resolve_plugin("ep_broken")


def test_entry_point_gone_after_cleanup():
    assert "ep_probe" not in registered_names()


@pytest.mark.parametrize("spec, message", [
    ("no_such_plugin", r"no plugin named 'no_such_plugin'; known: .*tiny_row_tp"),
    ("tests.plugins.no_such_module:Entry", "cannot import plugin module 'tests.plugins.no_such_module'"),
    ("tests.plugins.tiny:NoSuchEntry", "module 'tests.plugins.tiny' has no attribute 'NoSuchEntry'"),
    ("tests.plugins.tiny:reference", "which is not an Entry subclass or instance"),
    ("", "plugin must be a name"),
    (42, r"plugin must be a name, 'package.module:Entry', an Entry class or instance; got 42"),
    (dict, "got <class 'dict'>"),
])
def test_resolution_errors(spec, message):
    with pytest.raises(PluginError, match=message):
        resolve_plugin(spec)


def test_register_plugin_errors():
    with pytest.raises(PluginError, match="expects an Entry subclass"):
        register_plugin(object)

    class Nameless(Entry):
        pass

    with pytest.raises(PluginError, match="Nameless has no `name`"):
        register_plugin(Nameless)

    class Clash(Entry):
        name = "tiny_row_tp"

    with pytest.raises(PluginError, match="'tiny_row_tp' is already registered by tests.plugins.tiny.TinyRowTPEntry"):
        register_plugin(Clash)
    assert register_plugin(TinyRowTPEntry) is TinyRowTPEntry  # re-registering the same class is fine


# -- domain validation -----------------------------------------------------------------------------

class CountingEntry(Entry):
    """Declares no domain (the default: one rank only) and counts create() calls."""

    name = "counting"
    created = 0

    def create(self, plugin_args, ctx):
        type(self).created += 1
        return ProbeEntry().create(plugin_args, ctx)


def _args(plugin, **parallel) -> EngineArgs:
    return EngineArgs(plugin=plugin, config={"device": {"target": "cpu"}, "parallel": ParallelConfig(**parallel)})


def test_default_entry_rejects_tp2_before_anything_starts():
    threads = threading.active_count()
    CountingEntry.created = 0
    with pytest.raises(ParallelConfigError) as info:
        Engine(_args(CountingEntry, dense=DenseParallelConfig(tp_size=2)), DeploymentConfig.local())
    msg = str(info.value)
    assert "plugin counting implements parallel domains none (single rank only)" in msg
    assert "splits dense_tp=2" in msg
    assert CountingEntry.created == 0
    assert threading.active_count() == threads


def test_default_entry_runs_one_rank_inline():
    CountingEntry.created = 0
    with Engine(_args(CountingEntry)) as engine:
        assert engine.mode == "inline"
        assert engine.step({"op": "echo", "tag": 1}) == {"index": 0, "tag": 1}
    assert CountingEntry.created == 1


def test_declared_domain_accepted_and_inferred_dp_needs_no_declaration():
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=2))  # attention, moe inferred dp=2
    TinyRowTPEntry().check_parallel(parallel)


@pytest.mark.parametrize("parallel, shown", [
    (ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(dp_size=2)),
     "attention_dp=2"),
    (ParallelConfig(outer=OuterParallelConfig(pp_size=2)), "pp=2"),
    (ParallelConfig(outer=OuterParallelConfig(cfg_size=2), moe=MoeParallelConfig(ep_size=2)), "cfg=2, moe_ep=2"),
])
def test_undeclared_axes_are_rejected(parallel, shown):
    with pytest.raises(ParallelConfigError, match=f"implements parallel domains \\['dense'\\], but the config "
                                                  f"splits {shown}"):
        TinyRowTPEntry().check_parallel(parallel)


class SameTPEntry(Entry):
    """Tightened rule: dense and attention must use the same TP (CFG allowed), nothing else."""

    name = "same_tp"
    parallel_domains = frozenset({"dense", "attention", "cfg"})

    def validate_parallel(self, parallel):
        if parallel.dense.tp_size != parallel.attention.tp_size or parallel.attention.cp_size != 1:
            raise ParallelConfigError(
                f"same_tp needs dense.tp_size == attention.tp_size and no cp, got dense.tp_size="
                f"{parallel.dense.tp_size}, attention.tp_size={parallel.attention.tp_size}, "
                f"attention.cp_size={parallel.attention.cp_size}")


def test_validate_parallel_tightens():
    ok = ParallelConfig(outer=OuterParallelConfig(cfg_size=2), dense=DenseParallelConfig(tp_size=2),
                        attention=AttentionParallelConfig(tp_size=2))
    SameTPEntry().check_parallel(ok)
    bad = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(cp_size=2))
    with pytest.raises(ParallelConfigError, match="dense.tp_size=2, attention.tp_size=1, attention.cp_size=2"):
        SameTPEntry().check_parallel(bad)


def test_validate_parallel_rejection_stops_the_engine_before_create():
    class Tight(SameTPEntry):
        created = 0

        def create(self, plugin_args, ctx):
            type(self).created += 1

    parallel = {"dense": DenseParallelConfig(tp_size=2), "attention": AttentionParallelConfig(cp_size=2)}
    with pytest.raises(ParallelConfigError, match="same_tp needs"):
        Engine(_args(Tight, **parallel), DeploymentConfig.external())  # fails before reading launcher env
    assert Tight.created == 0


def test_unknown_declared_domain():
    class Typo(Entry):
        name = "typo"
        parallel_domains = frozenset({"dense", "expert"})

    with pytest.raises(ParallelConfigError, match=r"declares unknown parallel_domains \['expert'\]"):
        Typo().check_parallel(ParallelConfig())


def test_create_must_return_a_model_with_step():
    class NoStep(Entry):
        name = "no_step"

        def create(self, plugin_args, ctx):
            return object()

    with pytest.raises(TypeError, match="plugin no_step: create\\(\\) returned object, which has no step"):
        Engine(_args(NoStep))
