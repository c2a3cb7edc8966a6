"""The request path: intake, the local queue, the dispatcher, the engine thread and process, the
streamer, answers and records, cancellation, tracing. Uses `kafka` and `load`; never `worker.py`.
"""
