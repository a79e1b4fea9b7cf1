"""``--user-dir .../fairseq_agg``, the plugin's old location: the command works as with
``--user-dir "$(fairseq-agg)"`` (the plugin registers with fairseq), and says so in one log line.
fairseq imports this module only for that ``--user-dir`` (see the folder's docstring)."""
import logging

from fairseq_agg.registration import register_with_fairseq

logger = logging.getLogger("fairseq_agg")

logger.warning('--user-dir .../fairseq_agg is the plugin\'s old location; it still works, but pass '
               '--user-dir "$(fairseq-agg)" (fairseq_agg_plugin)')
register_with_fairseq()
