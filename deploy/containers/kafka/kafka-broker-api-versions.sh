#!/bin/sh
# The tool compose.yaml's health check runs, at the path the official apache/kafka image has it.
exec java -Xmx128m -Dlog4j2.configurationFile=/opt/kafka/config/tools-log4j2.properties -cp "/opt/kafka/libs/*" \
    org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
