"""Find Java and assemble Apache Kafka's jars from Maven Central (no Docker, no tarball download).

The jar folder is filled once by `mvn dependency:copy-dependencies` and marked with a stamp holding the
hash of the bundled pom.xml, so a second call costs one file read and a version bump refetches.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

POM_PATH = Path(__file__).with_name("pom.xml")
MIN_JAVA_MAJOR = 17
STAMP_NAME = ".pom-sha256"


class BrokerError(RuntimeError):
    """The local broker cannot be assembled, started or stopped; the message says what to do."""


def find_java() -> str:
    """Path of a Java >= 17 executable: $JAVA_HOME/bin/java if set, else `java` on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home, "bin", "java") if java_home else None
    java = str(candidate) if candidate and candidate.is_file() else shutil.which("java")
    if java is None:
        raise BrokerError(
            f"`java` not found (PATH or $JAVA_HOME): the local Kafka broker needs Java {MIN_JAVA_MAJOR} or newer "
            "(Debian/Ubuntu: apt-get install openjdk-17-jre-headless), "
            "or set KAFKA_BOOTSTRAP_SERVERS to a running broker"
        )
    major = java_major_version(java)
    if major < MIN_JAVA_MAJOR:
        raise BrokerError(f"{java} is Java {major}; Kafka 4 needs Java {MIN_JAVA_MAJOR} or newer")
    return java


def parse_java_major(version_output: str) -> int:
    """Major version from `java -version` output: '"17.0.15"' -> 17, legacy '"1.8.0_392"' -> 8."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if match is None:
        raise BrokerError(f"cannot read the Java version from: {version_output.strip()[:200]!r}")
    first, second = int(match.group(1)), int(match.group(2) or 0)
    return second if first == 1 else first


def java_major_version(java: str) -> int:
    # `java -version` writes to stderr on every JDK we know of; read both streams to be safe.
    proc = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    return parse_java_major(proc.stderr + proc.stdout)


def pom_digest(pom_path: Path = POM_PATH) -> str:
    return hashlib.sha256(pom_path.read_bytes()).hexdigest()


def jars_ready(kafka_dir: Path, pom_path: Path = POM_PATH) -> bool:
    stamp = kafka_dir / "libs" / STAMP_NAME
    return stamp.is_file() and stamp.read_text().strip() == pom_digest(pom_path)


def ensure_kafka_jars(kafka_dir: Path, pom_path: Path = POM_PATH) -> Path:
    """Return `kafka_dir/libs`, filling it from Maven Central first when missing or built from another pom."""
    libs_dir = kafka_dir / "libs"
    if jars_ready(kafka_dir, pom_path):
        return libs_dir
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(
            f"`mvn` not found: it fetches Apache Kafka's jars into {libs_dir} once "
            "(Debian/Ubuntu: apt-get install maven), or set KAFKA_BOOTSTRAP_SERVERS to a running broker"
        )
    kafka_dir.mkdir(parents=True, exist_ok=True)
    # Fetch into a private folder and rename, so an interrupted or concurrent fetch never leaves a half-filled
    # libs/ that a later run would mistake for complete.
    staging_dir = kafka_dir / f"libs.tmp-{os.getpid()}"
    shutil.rmtree(staging_dir, ignore_errors=True)
    pom_copy = kafka_dir / "pom.xml"  # mvn runs against a copy: the package folder may be read-only
    shutil.copyfile(pom_path, pom_copy)
    command = [
        mvn, "-q", "-B", "-f", str(pom_copy), "dependency:copy-dependencies",
        f"-DoutputDirectory={staging_dir}", "-DincludeScope=runtime",
    ]  # fmt: skip
    log.info("fetching Apache Kafka jars with Maven into %s (once)", libs_dir)
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(staging_dir, ignore_errors=True)
        tail = (proc.stdout + proc.stderr).strip()[-3000:]
        raise BrokerError(f"mvn could not fetch the Kafka jars (exit {proc.returncode}):\n{tail}")
    if not any(staging_dir.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"mvn finished but {staging_dir} holds no kafka_2.13 jar")
    (staging_dir / STAMP_NAME).write_text(pom_digest(pom_path) + "\n")
    old_dir = kafka_dir / f"libs.old-{os.getpid()}"
    if libs_dir.exists():
        libs_dir.rename(old_dir)
    try:
        staging_dir.rename(libs_dir)
    except OSError:
        # Another process renamed its complete copy first; theirs is as good as ours.
        shutil.rmtree(staging_dir, ignore_errors=True)
        if not jars_ready(kafka_dir, pom_path):
            raise
    shutil.rmtree(old_dir, ignore_errors=True)
    return libs_dir
