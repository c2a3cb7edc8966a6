"""The Kafka plumbing: clients and the assignor, the publisher and where records may go, the commit
watermark, exactly-once lanes, the access check, and the one place that reads aiokafka's private state.
Imports nothing from `load` or `requests`.
"""
