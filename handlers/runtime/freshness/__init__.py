"""Model freshness: the changed rows of embedding tables, published as delta files and written
into the served tables in place.

* ``layout``: where each table's rows lie in the served weights (``tables.json``, written by the
  build), and the base weights' fingerprint that deltas name;
* ``delta_file``: the delta file format (streamed in, validated before anything is applied);
* ``applier``: the row lock, and writing a delta's rows into the mapped weights file at a pace;
* ``worker``: a worker's side: replaying and following the model's delta log, the plugin's calls.
"""
