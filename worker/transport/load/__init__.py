"""The load policy: admission, shedding, backpressure, the service model behind the estimates, the
per-tick load decision and the autoscaling signal. Pure: no Kafka client, no torch; imports nothing from
`kafka` or `requests`.
"""
