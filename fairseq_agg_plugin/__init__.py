"""The directory fairseq's ``--user-dir`` loads (``fairseq-agg`` prints it): importing this package
registers fairseq-agg with fairseq (:func:`fairseq_agg.register_with_fairseq`).

It is a package of its own so that importing ``fairseq_agg`` changes nothing: fairseq imports a
``--user-dir`` by its directory's name, and not at all when a module of that name is already
imported, so a program that imported the core first still gets the plugin registered here.
"""
from fairseq_agg import register_with_fairseq

register_with_fairseq()
