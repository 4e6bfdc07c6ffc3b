"""The package as users get it: `from motet import Engine` and the rest of the face, the
model layer importable without Trio, and a built wheel (with the native kernels wherever
the checkout's install built them), installed in a fresh venv, that serves the web page
shipped inside it."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from conftest import COMPILE_CACHE, GOLDEN, REPO

import motet
from motet.model import native

TIMEOUT = 300  # seconds: the wheel's build compiles the native kernels


def test_the_face_names_each_engine_and_error_where_it_is_defined():
    from motet.engines.engine import Engine
    from motet.engines.split import SplitEngine
    from motet.model import load_model
    from motet.runtime.errors import EngineError

    assert (motet.Engine, motet.SplitEngine, motet.load_model, motet.EngineError) == (
        Engine, SplitEngine, load_model, EngineError)
    for name in motet.__all__:
        assert getattr(motet, name) is not None, name
    for name in ("MuxEngine", "RestartingEngine", "EngineAPI", "BadRequest", "SessionError", "ModelFileError"):
        assert isinstance(getattr(motet, name), type), name
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        motet.Engin  # noqa: B018 - a typo is an AttributeError, not an import of something else


def test_the_model_layer_imports_without_trio():
    probe = "import sys, motet, motet.model; print('trio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


def fresh_venv(folder: Path, wheel: Path) -> Path:
    """A venv holding only the wheel's motet; its dependencies are this environment's,
    reached through a .pth line (whose own .pth files, such as the editable install's
    finder, are not run from there)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


async def test_a_wheel_in_a_fresh_venv_serves_the_page_it_ships(tmp_path):
    wheels = tmp_path / "wheels"
    await trio.run_process([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                           capture_stdout=True, capture_stderr=True)
    wheel = next(wheels.glob("motet-*.whl"))
    kernels = [name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("motet/model/_qmatmul")]
    assert len(kernels) == native.available(), kernels  # built where the checkout's install built them
    python = await trio.to_thread.run_sync(fresh_venv, tmp_path / "venv", wheel)
    where = subprocess.run([str(python), "-c", "import motet; print(motet.__file__)"], capture_output=True,
                           text=True, check=True, cwd=tmp_path).stdout.strip()
    assert Path(where).is_relative_to(tmp_path / "venv"), where  # the wheel's copy, not the checkout

    command = [str(python), "-m", "motet", "serve", "--model", str(GOLDEN / "llama"), "--port", "0",
               "--kv-slots", "1", "--max-context", "128", "--compile-cache", str(COMPILE_CACHE)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            process = await nursery.start(partial(trio.run_process, command, cwd=tmp_path, env=env, check=False,
                                                  stderr=subprocess.PIPE))
            err = b""
            while b"python -c" not in err:  # the banner's last line
                chunk = await process.stderr.receive_some(65536)
                assert chunk, err.decode()
                err += chunk
            url = err.decode().split(" at ", 1)[1].split()[0]
            async with httpx.AsyncClient(base_url=url) as http:
                page = await http.get("/")
            process.terminate()
    assert page.status_code == 200
    assert page.content == (REPO / "motet" / "web" / "index.html").read_bytes()


def test_no_module_is_over_400_lines():
    """docs/architecture.md: a module does one thing and is read whole."""
    long = {str(path.relative_to(REPO)): n for path in (REPO / "motet").rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 400}
    assert long == {}
