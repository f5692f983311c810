"""`python -m pagekeeper_vllm.bundle DEST`: the plugin and the launcher as a directory for vLLM.

An init container from the engine image runs this into a volume the vLLM container mounts
read-only and puts on `PYTHONPATH`: this package, the pure engine modules it reuses (never torch
code that vLLM's own torch could not run), and a `pagekeeper_vllm-<version>.dist-info` whose
entry point makes vLLM's `load_general_plugins()` find the plugin. Nothing is compiled or
installed; the stock vLLM image's Python runs it as it is.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT = "pagekeeper_vllm.plugin:register"
DIST_NAME = "pagekeeper_vllm"
# Packages copied whole, and single modules (with their parents' __init__.py).
PACKAGES: tuple[str, ...] = ("pagekeeper_vllm",)
MODULES: tuple[str, ...] = (
    "pagekeeper_engine.faults",
    "pagekeeper_engine.memory.allocator",
    "pagekeeper_engine.memory.cuda",
    "pagekeeper_engine.memory.oom",
    "pagekeeper_engine.stuck",
    "pagekeeper_engine.frontend.metric_names",
)


def _version() -> str:
    try:
        return importlib.metadata.version("pagekeeper")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _origin(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} is not importable"
    return Path(spec.origin)


def _copy(source: Path, dest_root: Path, module: str) -> Path:
    parts = module.split(".")
    target = (
        dest_root.joinpath(*parts[:-1], source.name)
        if source.name != "__init__.py"
        else (dest_root.joinpath(*parts, "__init__.py"))
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def write_bundle(dest: Path) -> list[Path]:
    """Write the bundle into `dest` (created if missing); the files written."""
    from pagekeeper_vllm.plugin import PLUGIN_NAME  # noqa: PLC0415

    dest.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for package in PACKAGES:
        root = _origin(package).parent
        for source in sorted(root.glob("*.py")):
            name = package if source.stem == "__init__" else f"{package}.{source.stem}"
            written.append(_copy(source, dest, name))
    for module in MODULES:
        parts = module.split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            written.append(_copy(_origin(parent), dest, parent))
        written.append(_copy(_origin(module), dest, module))
    version = _version()
    info = dest / f"{DIST_NAME}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    files = {
        "METADATA": (
            f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {version}\n"
            "Summary: pagekeeper's allocator exporter plugin and launcher for vLLM\n"
        ),
        "entry_points.txt": f"[{ENTRY_POINT_GROUP}]\n{PLUGIN_NAME} = {ENTRY_POINT}\n",
        "top_level.txt": "".join(f"{name}\n" for name in ("pagekeeper_engine", *PACKAGES)),
    }
    for name, text in files.items():
        (info / name).write_text(text)
        written.append(info / name)
    return sorted(set(written))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagekeeper_vllm.bundle",
        description="Write pagekeeper's vLLM plugin and launcher into DEST (for PYTHONPATH).",
    )
    parser.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    files = write_bundle(args.dest)
    print(f"pagekeeper: wrote {len(files)} files of the vLLM plugin into {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
