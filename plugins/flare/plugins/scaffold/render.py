"""Render a skeleton: the example package of a kind, renamed, written all or nothing.

A template tree is the example package with `.tmpl` appended to every file
name; `Kind.renames` lists the example's own names (as literal text) and what
each becomes for the new name, applied in order to every file's text and path.
The tree is written to a temporary sibling folder and renamed into place at the
end, so a failure leaves nothing behind, and an existing folder is never
overwritten.
"""
from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flare.core.errors import InputError

TEMPLATES = Path(__file__).resolve().parent / "templates"
SUFFIX = ".tmpl"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[-_]", name))


def _snake(name: str) -> str:
    return name.replace("-", "_")


@dataclass(frozen=True)
class Kind:
    """One kind of skeleton: its template folder, the folder it writes, the name rule."""

    template: str
    folder: Callable[[str], str]
    pattern: str
    rule: str
    renames: Callable[[str], list[tuple[str, str]]]

    def check(self, name: str) -> None:
        if not re.fullmatch(self.pattern, name):
            raise InputError(f"{self.template} name {name!r}: {self.rule}")


KINDS = {
    # the mirror backend: `mirror` names the backend, its module, classes and environment variable
    "backend": Kind(
        "backend", lambda n: f"flare-backend-{n}", r"[a-z][a-z0-9_]{0,31}",
        "lowercase letters, digits and '_', starting with a letter (it names devices: NAME:0)",
        lambda n: [("mirror", n), ("Mirror", _camel(n)), ("MIRROR", n.upper())]),
    # tiny-moe: `flare-model-tiny` the distribution, `flare_tiny_moe` the module, `tiny-moe` the model
    "model": Kind(
        "model", lambda n: f"flare-model-{n}", r"[a-z][a-z0-9]*(-[a-z0-9]+)*",
        "lowercase letters and digits, words joined by '-' (e.g. my-lm)",
        lambda n: [("flare-model-tiny", f"flare-model-{n}"), ("flare_tiny_moe", f"flare_{_snake(n)}"),
                   ("tiny-moe", n), ("tiny_moe", _snake(n)), ("TinyConfig", f"{_camel(n)}Config")]),
}


def _apply(text: str, renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        text = text.replace(old, new)
    return text


def render(kind: str, name: str) -> dict[str, str]:
    """{relative path: text} of the skeleton `kind` for `name` (nothing written)."""
    spec = KINDS[kind]
    spec.check(name)
    renames = spec.renames(name)
    root = TEMPLATES / spec.template
    files = {}
    for path in sorted(root.rglob(f"*{SUFFIX}")):
        rel = path.relative_to(root).as_posix()[: -len(SUFFIX)]
        files[_apply(rel, renames)] = _apply(path.read_text(encoding="utf-8"), renames)
    if not files:
        raise FileNotFoundError(f"no templates under {root}: the installation is incomplete")
    return files


def write(kind: str, name: str, parent: Path) -> Path:
    """Write the skeleton into `parent / KINDS[kind].folder(name)`; InputError if it exists."""
    files = render(kind, name)
    target = Path(parent) / KINDS[kind].folder(name)
    if target.exists():
        raise InputError(f"{target}: already exists; choose another NAME or --output folder")
    parent = Path(parent)
    if not parent.is_dir():
        raise InputError(f"--output {str(parent)!r}: not a folder")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
    try:
        for rel, text in files.items():
            out = staging / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text, encoding="utf-8")
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
