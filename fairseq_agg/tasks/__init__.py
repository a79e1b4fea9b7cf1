"""No fairseq tasks: the folder fairseq's ``--user-dir .../fairseq_agg`` reaches.

That directory was the plugin's ``--user-dir`` before it moved to ``fairseq_agg_plugin/``. fairseq
imports a user dir by its directory's name, here this package, whose import changes nothing; then
it imports every module of the directory's ``tasks/`` (and ``models/``) folder. Nothing else
imports this folder, so its one module, :mod:`.old_user_dir`, runs exactly when a command names the
old location.
"""
