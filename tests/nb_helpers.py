"""Run a notebook of ``notebooks/`` top to bottom in a fresh kernel (for the tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_notebook(name: str) -> tuple[list[dict], str]:
    """Execute ``notebooks/<name>`` with its folder as the working directory.

    Skips the calling test, naming the install, when nbclient / nbformat / ipykernel are missing.

    Args:
        name: the notebook's file name.
    Returns:
        ``(outputs, text)``: every code cell's outputs, and their stream text plus Markdown joined.
    Raises:
        AssertionError: a cell raised (its error output is in the message).
    """
    hint = "pip install 'patchkv-agent[test]'"
    nbclient = pytest.importorskip("nbclient", reason=f"nbclient not installed: {hint}")
    nbformat = pytest.importorskip("nbformat", reason=f"nbformat not installed: {hint}")
    pytest.importorskip("ipykernel", reason=f"ipykernel not installed: {hint}")
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    import os

    saved = os.environ.get("PYTHONPATH")
    # the kernel imports the checkout's benchmark harness (benchmarks/, beside the package, not installed)
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), saved) if x)
    try:
        client.execute()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/markdown", "")) for o in outputs)
    return outputs, text
