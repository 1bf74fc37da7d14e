"""What two or more benchmark modes share: the mode protocol (``harness``), tables, JSON and plots
(``report``), the servers' ports (``ports``), a private ``redis-server`` (``redis_local``), a
``kvstore serve`` daemon (``node_daemon``), vLLM engines in process (``engine``) and in a process of
their own (``engine_job``), the tiny model they run (``tiny_model``), stores sized in blocks
(``stores``) and the engine's block files on disk (``fault_files``)."""
