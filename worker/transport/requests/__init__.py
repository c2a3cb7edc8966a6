"""The request path: intake, the lifecycle (one owner per request), the local queue, the dispatcher, the
engine thread and process, the streamer, answers and records, cancels, tracing. Uses `kafka` and `load`;
never `worker.py`.
"""
