"""kombu's own integration test mixins (t/integration/common.py of kombu's source distribution), taken from the
package index at test time for the kombu installed here, never copied into this repository.

``integration_common()`` downloads the sdist once (``pip download kombu==VERSION --no-binary :all: --no-deps``)
into a cache directory ($CFEMU_TEST_CACHE, else ~/.cache/cfemu-tests), extracts t/integration/common.py and
imports it as a module. A download that fails raises, naming the command (the test module fails one test
with it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

MODULE_NAME = "kombu_integration_common"


def cache_dir() -> Path:
    return Path(os.environ.get("CFEMU_TEST_CACHE") or Path.home() / ".cache" / "cfemu-tests")


def _sdist(version: str) -> Path:
    d = cache_dir() / f"kombu-{version}"
    d.mkdir(parents=True, exist_ok=True)
    found = sorted(d.glob(f"kombu-{version}.tar.gz"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", f"kombu=={version}", "--no-binary", ":all:", "--no-deps",
           "--no-build-isolation", "--disable-pip-version-check", "-q", "-d", str(d)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    found = sorted(d.glob(f"kombu-{version}.tar.gz"))
    if r.returncode != 0 or not found:
        raise RuntimeError(f"could not download kombu's sdist ({' '.join(cmd)}): {r.stderr.strip()[-2000:]}")
    return found[0]


def integration_source(version: str) -> Path:
    """t/integration/common.py of kombu ``version``'s sdist, extracted beside it."""
    target = cache_dir() / f"kombu-{version}" / "t-integration-common.py"
    if not target.exists():
        with tarfile.open(_sdist(version)) as tar:
            member = tar.getmember(f"kombu-{version}/t/integration/common.py")
            f = tar.extractfile(member)
            assert f is not None
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(f.read())
            tmp.replace(target)
    return target


def integration_common() -> ModuleType:
    """kombu's integration mixins (BasicFunctionality, BaseMessage, BasePriority, BaseFailover, ...)."""
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    import kombu

    path = integration_source(kombu.__version__)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        with contextlib.suppress(KeyError):
            del sys.modules[MODULE_NAME]
        raise
    return module


def missing_mixins() -> SimpleNamespace:
    """Stand-ins for the mixins when the download failed: classes without tests (the caller fails one test)."""
    names = ("BasicFunctionality", "BaseMessage", "BasePriority", "BaseExchangeTypes", "BaseTimeToLive",
             "BaseFailover", "BaseEventLoop")
    return SimpleNamespace(**{n: type(n, (), {"test_fanout": lambda self, connection: None}) for n in names})


def queue_names(module: ModuleType) -> list[str]:
    """The queue names the mixins use (so that a test finds its queues empty whatever ran before it)."""
    assert module.__file__ is not None
    text = Path(module.__file__).read_text()
    return sorted(set(re.findall(r"(?:Queue|SimpleQueue|SimpleBuffer)\(\s*'([A-Za-z0-9_.\-]+)'", text)))
