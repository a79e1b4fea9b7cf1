"""numpy 2: fairseq's Cython extensions built against numpy 1.x do not import under numpy 2, and
fairseq says so only at the first batch, as "Please build Cython components";
:func:`check_fairseq_extensions_match_numpy` says it when the plugin registers, naming the fix."""
import contextlib
import importlib
import io

from fairseq_agg.errors import InstallError

# fairseq's extension compiled against numpy's C API that fairseq-train needs for its first batch
# (data_utils.batch_by_size); token_block_utils_fast is built and fails alongside it.
NUMPY_EXTENSION = "fairseq.data.data_utils_fast"


def _installed_fairseq() -> str:
    """``NAME==VERSION`` of the distribution that installed fairseq (fairseq, fairseq-fixed, ...)."""
    from importlib import metadata

    names = getattr(metadata, "packages_distributions", dict)().get("fairseq") or ["fairseq"]
    try:
        return f"{names[0]}=={metadata.version(names[0])}"
    except metadata.PackageNotFoundError:
        return names[0]


def check_fairseq_extensions_match_numpy():
    """Under numpy >= 2, refuses a fairseq whose compiled extensions were built against numpy 1.x,
    with one line naming the two fixes (an ImportError) (fairseq itself fails only at the first batch,
    with "Please build Cython components"). Under numpy 1.x nothing is imported; an extension
    missing for another reason (fairseq built without them) is left to fairseq's own message."""
    import numpy

    if int(numpy.__version__.split(".")[0]) < 2:
        return
    try:
        # numpy writes its own explanation and a stack listing to sys.stderr before it fails
        with contextlib.redirect_stderr(io.StringIO()):
            importlib.import_module(NUMPY_EXTENSION)
    except ImportError as e:
        if "numpy" not in str(e).lower():
            return
        raise InstallError(
            f"fairseq's compiled extensions ({NUMPY_EXTENSION}) were built against numpy 1.x and do not "
            f"import under numpy {numpy.__version__}: rebuild them with pip install --no-build-isolation "
            f"--no-deps --force-reinstall --no-cache-dir {_installed_fairseq()}, or pip install 'numpy<2'"
        ) from None
