"""Loads the extension ``torch_fsdp_ext._C``, after checking what it was built against.

Its build writes ``_build_info.py`` beside it (CMakeLists.txt): the torch and the
UCX it was built against. Two things follow from it before ``_C`` loads:

- A ``_C`` built for another torch would fail with an undefined symbol, or load
  and misbehave; it is refused with a message that says how to rebuild.
- A ``_C`` built against the UCX of PyPI's ``libucx`` wheel (``libucx-cu13``)
  finds those libraries only once the wheel has loaded them
  (``libucx.load_library()``): they are not on the loader's path. A system UCX
  is found by the loader as usual.

After it loads, the UCX the loader bound must be at least the one built against
(UCX keeps its ABI within a major version, for newer libraries only).
"""

import torch

_REBUILD = "rebuild it: `make build`, or `pip install --no-build-isolation .` in this environment"


def _version_tuple(version: str) -> tuple:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def _load():
    try:
        from . import _build_info as build
    except ImportError:
        raise ImportError(f"torch_fsdp_ext._C is not built; {_REBUILD}") from None
    if build.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"torch_fsdp_ext._C was built for torch {build.TORCH_VERSION}, but this is torch "
            f"{torch.__version__} ({torch.__file__}); {_REBUILD}"
        )
    if build.UCX_SOURCE == "wheel":
        try:
            import libucx
        except ImportError:
            raise ImportError(
                f"torch_fsdp_ext._C was built against UCX {build.UCX_VERSION} from PyPI's libucx "
                "wheel, which this environment lacks: pip install libucx-cu13"
            ) from None
        libucx.load_library()
    from . import _C

    loaded = _C._ucx_library()
    if _version_tuple(loaded["version"]) < _version_tuple(build.UCX_VERSION):
        raise ImportError(
            f"torch_fsdp_ext._C was built against UCX {build.UCX_VERSION} ({build.UCX_SOURCE}) "
            f"but the loader bound UCX {loaded['version']} in {loaded['directory']}, which is "
            "older; load the newer one first (LD_LIBRARY_PATH) or " + _REBUILD
        )
    return _C


_C = _load()
