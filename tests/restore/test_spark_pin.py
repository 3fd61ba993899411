"""One Spark version everywhere: the project's dependency pin, the image's, compose's, the image builder's, and
the pyspark installed here (PySpark refuses a driver and workers of different versions)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_spark_version_is_pinned_the_same_everywhere() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["spark"]
    pins = [re.fullmatch(r"pyspark==([\d.]+)", d) for d in extra]
    version = next(m.group(1) for m in pins if m)
    assert re.search(rf"^ARG SPARK_VERSION={re.escape(version)}$", (ROOT / "Dockerfile").read_text(), re.M)
    compose = (ROOT / "docker-compose.yml").read_text()
    defaults = re.findall(r"\$\{SPARK_VERSION:-([\d.]+)\}", compose)
    assert len(defaults) >= 3 and set(defaults) == {version}
    assert re.search(rf"SPARK_VERSION=\$\{{SPARK_VERSION:-{re.escape(version)}\}}",
                     (ROOT / "docker" / "build-images.sh").read_text())
    import pyspark

    assert pyspark.__version__ == version
