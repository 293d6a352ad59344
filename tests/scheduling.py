"""How ``make test`` shares its tests between xdist's processes, and the record of test durations
that orders them.

Most of the suite's time is building compiled engines held by module- and session-scoped fixtures,
many parametrised by family. xdist's own modes either hand tests out one by one (both processes then
build many of the same engines) or whole modules (the contract module's 19 families then run on one
process at the end), and its groups are inert with pytest 9 (xdist names a group by rewriting
``item._nodeid``, which pytest 9 no longer reads). None of its modes keeps together the tests that
share a fixture's instance, so this plugin does, by hand: each process's collection works out which
tests share an instance of a module- or session-scoped fixture (a parametrised fixture's instance
being one per parameter, as pytest caches it), the scheduler, a thin subclass of xdist's
``LoadScopeScheduling``, makes each such set one unit and hands the units out longest first by the
durations recorded from a run of the whole suite (``tests/durations.json``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from hotlora.durable import write_atomic

DURATIONS = Path(__file__).with_name("durations.json")
# Set to a path to record this run's durations there; tests/durations.json is such a record of a run
# from an empty compile cache (the case CI runs): `make test-durations`.
STORE_DURATIONS_ENV = "HOTLORA_STORE_TEST_DURATIONS"
# A test the record does not know yet: one of the unit tests costs well under a second; elsewhere
# most tests stand on an engine compiled for them.
UNRECORDED_S = {"tests/unit/": 0.2}
UNRECORDED_DEFAULT_S = 20.0
# Tests that run together whatever fixtures they share: the Ray tests (one local cluster at a time on
# the machine).
TOGETHER = ("tests/ray/",)
UNITS_KEY = "hotlora_test_units"


def shared_instances(item) -> set[tuple]:
    """The instances of module- and session-scoped fixtures the test uses, each as pytest keeps it:
    a parametrised fixture (or one that depends on one) once per parameter; a session fixture without
    parameters is left out, since each process builds its own anyway."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    definitions = item._fixtureinfo.name2fixturedefs
    instances = set()
    for name in item.fixturenames:
        if not definitions.get(name):
            continue
        scope = definitions[name][-1].scope
        if scope == "function":
            continue
        closure, pending = set(), [name]
        while pending:
            dependency = pending.pop()
            if dependency not in closure:
                closure.add(dependency)
                pending.extend(definitions[dependency][-1].argnames if definitions.get(dependency) else ())
        parameters = tuple(sorted((n, repr(params[n])) for n in closure if n in params))
        if scope == "session":
            if parameters:
                instances.add((name, parameters))
        else:
            instances.add((item.nodeid.split("::")[0], name, parameters))
    return instances


def units_of(items) -> dict[str, str]:
    """nodeid -> unit: tests joined where they share a fixture's instance (union-find)."""
    parent: dict = {}

    def root(node):
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for item in items:
        root(item.nodeid)
        together = next((prefix for prefix in TOGETHER if item.nodeid.startswith(prefix)), None)
        for instance in shared_instances(item) | ({("together", together)} if together else set()):
            parent[root(item.nodeid)] = root(instance)
    names: dict = {}
    return {item.nodeid: names.setdefault(root(item.nodeid), f"{item.nodeid.split('::')[0]}#{len(names)}")
            for item in items}


def recorded_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def estimated_duration(nodeid: str, record: dict[str, float]) -> float:
    if nodeid in record:
        return record[nodeid]
    return next((s for prefix, s in UNRECORDED_S.items() if nodeid.startswith(prefix)), UNRECORDED_DEFAULT_S)


class SharedFixtureScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with the units the workers' collections worked out, longest first."""

    def __init__(self, config, log, units_file: Path):
        super().__init__(config, log)
        self._units_file = units_file
        self._units: dict[str, str] | None = None
        self._record = recorded_durations()
        self._ordered = False

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:
            # Written by the processes during their collection, which has finished by the time the
            # scheduler splits anything (none where a collection failed: units are then modules).
            try:
                self._units = json.loads(self._units_file.read_text())
            except FileNotFoundError:
                self._units = {}
        return self._units.get(nodeid) or nodeid.split("::")[0]

    def _assign_work_unit(self, node) -> None:
        if not self._ordered:
            # The parent fills ``workqueue`` in collection order; reorder it by estimated time
            # before the first unit goes out.
            units = sorted(self.workqueue.items(), key=lambda unit: -self._cost(unit[1]))
            self.workqueue.clear()
            self.workqueue.update(units)
            self._ordered = True
        super()._assign_work_unit(node)

    def _cost(self, tests: dict[str, bool]) -> float:
        return sum(estimated_duration(nodeid, self._record) for nodeid in tests)


class DurationRecorder:
    """Sums each test's setup, call and teardown as the reports reach the controlling process."""

    def __init__(self, path: Path):
        self.path = path
        self.durations: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, exitstatus) -> None:
        if exitstatus != 0:  # a failed run's timings must not replace the record the order comes from
            return
        record = {nodeid: round(seconds, 2) for nodeid, seconds in sorted(self.durations.items())}
        # Whole or not at all: a record cut short by a kill would stop the next run's scheduler.
        write_atomic(self.path, (json.dumps(record, indent=0) + "\n").encode())


class Scheduling:
    """The plugin: on the controlling process, the scheduler and the duration record; on each test
    process, the units written out after collection."""

    def __init__(self):
        self.units_file = Path(tempfile.mkdtemp(prefix="hotlora-units-")) / "units.json"

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        return SharedFixtureScheduling(config, log, self.units_file)

    def pytest_configure_node(self, node):
        node.workerinput[UNITS_KEY] = str(self.units_file)

    def pytest_unconfigure(self):
        shutil.rmtree(self.units_file.parent, ignore_errors=True)


class UnitsWriter:
    def __init__(self, path: Path):
        self.path = path

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        # After deselection (-m): the units of the tests that run. Every process collects the same
        # tests, so whichever writes last writes the same units.
        write_atomic(self.path, json.dumps(units_of(items)).encode())


def register(config) -> None:
    worker_input = getattr(config, "workerinput", None)
    if worker_input is None:
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(Scheduling(), "hotlora-scheduling")
        path = os.environ.get(STORE_DURATIONS_ENV)
        if path:
            config.pluginmanager.register(DurationRecorder(Path(path)), "hotlora-durations")
    elif UNITS_KEY in worker_input:
        config.pluginmanager.register(UnitsWriter(Path(worker_input[UNITS_KEY])), "hotlora-units")
