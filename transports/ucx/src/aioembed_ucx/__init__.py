"""aioembed-ucx: the UCX transport for aioembed, built on ucxx.

Select it with ``TransferConfig(transport="ucx", transport_options={...})``; the plugin is
found through the ``aioembed.transports`` entry point. ucxx itself is imported only when an
endpoint is opened, so this package imports (and reports a missing extra clearly) without it.
"""

from aioembed_ucx._options import PROGRESS_MODES, UcxOptions
from aioembed_ucx.transport import UcxLink, UcxTransport

__version__ = "0.1.0"

__all__ = ["PROGRESS_MODES", "UcxLink", "UcxOptions", "UcxTransport", "__version__"]
