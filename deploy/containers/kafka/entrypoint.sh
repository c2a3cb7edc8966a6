#!/bin/sh
# Starts a KRaft broker configured the way the official apache/kafka image is: every KAFKA_* variable is a
# server property (KAFKA_ dropped, lower case, "_" -> ".", "__" -> "_", "___" -> "-"), CLUSTER_ID names the
# cluster, and the storage is formatted on first start only. compose.yaml then works with either image.
set -eu

CONFIG_DIR=/opt/kafka/config
PROPERTIES="$CONFIG_DIR/server.properties"
: "${CLUSTER_ID:?set CLUSTER_ID (kafka-storage random-uuid makes one)}"

# The JVM's own options share the prefix but are not server properties.
is_jvm_option() {
    case "$1" in
        KAFKA_HEAP_OPTS|KAFKA_OPTS|KAFKA_JVM_PERFORMANCE_OPTS|KAFKA_GC_LOG_OPTS|KAFKA_JMX_OPTS|KAFKA_LOG4J_OPTS) return 0 ;;
        *) return 1 ;;
    esac
}

{
    echo "log.dirs=/var/lib/kafka/data"
    env | grep '^KAFKA_' | while IFS= read -r line; do
        name=${line%%=*}
        value=${line#*=}
        is_jvm_option "$name" && continue
        key=$(printf '%s' "${name#KAFKA_}" | tr 'A-Z' 'a-z' | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g')
        printf '%s=%s\n' "$key" "$value"
    done
} > "$PROPERTIES"  # a later line wins: KAFKA_LOG_DIRS overrides the default above

CLASSPATH="/opt/kafka/libs/*"
LOG4J="-Dlog4j2.configurationFile=$CONFIG_DIR/log4j2.properties"
# --ignore-formatted: a restarted container keeps its topics.
java $LOG4J -cp "$CLASSPATH" kafka.tools.StorageTool format --cluster-id "$CLUSTER_ID" -c "$PROPERTIES" \
    --ignore-formatted

# shellcheck disable=SC2086  # the *_OPTS variables are lists of JVM options
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx1g} -XX:+UseG1GC -Djava.awt.headless=true ${KAFKA_OPTS:-} $LOG4J \
    -Dkafka.logs.dir=/var/lib/kafka -cp "$CLASSPATH" kafka.Kafka "$PROPERTIES"
