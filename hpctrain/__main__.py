"""``python -m hpctrain``: any unhandled exception on any rank aborts the whole job."""

import sys

from hpctrain.cli import main
from hpctrain.runtime.abort import abort_on_exception

if __name__ == "__main__":
    sys.exit(abort_on_exception(main))
