"""`workspace_sharing = false`: every entry point of a model on its own workspace.

A PreparedGraph's entry points (silero-vad's `stream`/`frontend`/`recur`) share
one workspace, so their arenas overlap and memory is the largest need. To show
what that sharing saves, the benchmark needs the same model *without* it. The
model runners call `session.prepare_model(name, options, ...)` and then only
`execute`/`prepare`/`reset`/`release`/`describe` on what it returns; so a
session stand-in whose `prepare_model` builds one PreparedGraph (with its own
workspace) per entry point gives the unshared configuration without touching
any model code. Entries that share state tensors would each get their own copy
of the state, which is why a workload kind must declare `entries_separable`.
Weights used by several entries are uploaded once per entry here, so compare
the `workspace_bytes` of describe() (arenas only) to see what sharing saves;
the ledger peak includes the duplicated weights too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from flare.core.prepared import EntryBuilder, HostCallback, PreparedGraph
    from flare.core.session import Session


class PerEntrySession:
    """Looks like the wrapped Session, except that `prepare` gives each entry point its own
    PreparedGraph and workspace."""

    def __init__(self, session: "Session"):
        self._session = session

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def prepare_model(self, model: str, options: Mapping[str, Any] | None = None, *, shapes: Any = None,
                      placement: Any = None, workspace: Any = None, strict: bool = False,
                      **extra: Any) -> "PerEntryGraph":
        """`Session.prepare_model`, with one PreparedGraph (and workspace) per entry point."""
        p = self._session.model_preparation(model, options, placement=placement)
        return self.prepare(p.entries, shapes if shapes is not None else p.shapes, placement=p.placement,
                            strict=strict, name=p.name, callbacks=p.callbacks, **extra)

    def prepare(self, entries: Mapping[str, "EntryBuilder"], shapes: Mapping[str, Mapping[str, Sequence[int]]], *,
                workspace: Any = None, placement: Any = None, strict: bool = False, name: str = "graph",
                callbacks: Mapping[str, "HostCallback"] | None = None, **extra: Any) -> "PerEntryGraph":
        """One PreparedGraph per entry point; `extra` keywords (e.g. `tuning`) go to each unchanged."""
        graphs: dict[str, "PreparedGraph"] = {}
        try:
            for entry, builder in entries.items():
                ws = self._session.workspace(f"{name}.{entry}:workspace")
                graphs[entry] = self._session.prepare({entry: builder},
                                                      {entry: shapes[entry]} if entry in shapes else {},
                                                      workspace=ws, placement=placement, strict=strict,
                                                      name=f"{name}.{entry}", callbacks=callbacks, **extra)
        except BaseException:
            for g in graphs.values():
                g.release()
            raise
        return PerEntryGraph(name, graphs)


class PerEntryGraph:
    """The PreparedGraph calls a model runner makes, routed to one graph per entry point."""

    def __init__(self, name: str, graphs: Mapping[str, "PreparedGraph"]):
        self.name = name
        self.graphs = dict(graphs)

    @property
    def released(self) -> bool:
        return all(g.released for g in self.graphs.values())

    def prepare(self, entry: str, shapes: Mapping[str, Sequence[int]]) -> Any:
        return self._graph(entry).prepare(entry, shapes)

    def execute(self, entry: str, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        return self._graph(entry).execute(entry, **inputs)

    def reset(self) -> None:
        for g in self.graphs.values():
            g.reset()

    def release(self) -> None:
        for g in self.graphs.values():
            g.release()

    def describe(self) -> dict[str, Any]:
        """PreparedGraph.describe() of every entry, merged (persistent and workspace bytes summed)."""
        out: dict[str, Any] = {"name": self.name, "entries": {}, "persistent_bytes": {}, "workspace_bytes": {}}
        for g in self.graphs.values():
            info = g.describe()
            out["entries"].update(info["entries"])
            for key in ("persistent_bytes", "workspace_bytes"):
                for dev, n in info[key].items():
                    out[key][dev] = out[key].get(dev, 0) + n
        return out

    def _graph(self, entry: str) -> "PreparedGraph":
        from flare.core.errors import InputError

        if entry not in self.graphs:
            raise InputError(f"unknown entry point {entry!r}; {self.name} has {sorted(self.graphs)}")
        return self.graphs[entry]

    def __enter__(self) -> "PerEntryGraph":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
