-- Flink SQL over kvbus's topics, read with Flink's standard Kafka connector and avro-confluent
-- format through the registry's Confluent-compatible API (Apicurio ccompat). Run it with
--   .venv/bin/python -m kvbus.analytics.flink_job            (or: ./dev test -m analytics)
-- which fills in the {placeholders} from the KVBUS_* settings and the reader schemas, and prints
-- each named query's rows as JSON lines.
--
-- Block layouts: the consolidated events come as a BlockEvent record per event on kvbus.blocks and its
-- tier topics (layout 1, table blocks) or as a BlockEvents record per engine batch, holder and tier on
-- kvbus.blocks-packed and its tier topics (layout 2, the worker's default, table blocks_packed). The view
-- block_events has one row per event of both: blocks as it is, and blocks_packed with its events array
-- unnested (CROSS JOIN UNNEST), each entry's index and event with its record's fields.
--
-- Reader schemas ({blocks_reader_schema}, {packed_reader_schema}, {raw_reader_schema}): kvbus's event
-- field is a union of four records (BlockStored, BlockRemoved, AllBlocksCleared, Reset), which a Flink
-- table cannot declare, and block hashes are Avro fixed(8), which the schema Flink derives from a table
-- maps to bytes ("AvroTypeException: Found kvbus.BlockHash, expecting bytes"). analytics/flink_job.py derives
-- from schemas/avro/*.avsc a reader schema in which the union is one record of the branch fields
-- used below, each nullable: Avro's schema resolution then reads every branch into it
-- (block_size is set only for BlockStored, block_hashes null only for AllBlocksCleared and Reset,
-- reason set only for Reset). The table's columns must match it (Flink checks).
--
-- Windows are over the Kafka record time (the connector's `timestamp` metadata: the time the stage
-- that wrote the record stamped), as in `kvbus report`: an engine whose clock is off would otherwise
-- put its events in windows far from the others' and move the watermark with them. `ts` (the
-- engine's time) stays a column.

SET 'table.local-time-zone' = 'UTC';

CREATE TABLE blocks (
  replica STRING NOT NULL,
  dp_rank INT NOT NULL,
  epoch BIGINT NOT NULL,
  seq BIGINT NOT NULL,
  `index` INT NOT NULL,
  ts DOUBLE NOT NULL,
  event ROW<block_hashes ARRAY<VARBINARY(8) NOT NULL>, block_size INT, medium STRING, ownership STRING,
            reason STRING> NOT NULL,
  model STRING,
  record_time TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
  WATERMARK FOR record_time AS record_time - INTERVAL '10' SECOND
) WITH (
  'connector' = 'kafka',
  'topic-pattern' = '{blocks_topic_regex}',
  'properties.bootstrap.servers' = '{bootstrap}',
  'properties.group.id' = '{group}',
  'scan.startup.mode' = 'earliest-offset',
  'scan.bounded.mode' = 'latest-offset',
  'format' = 'avro-confluent',
  'avro-confluent.url' = '{registry_url}',
  'avro-confluent.schema' = '{blocks_reader_schema}'
);

CREATE TABLE blocks_packed (
  replica STRING NOT NULL,
  dp_rank INT NOT NULL,
  epoch BIGINT NOT NULL,
  seq BIGINT NOT NULL,
  ts DOUBLE NOT NULL,
  model STRING,
  events ARRAY<ROW<`index` INT NOT NULL,
                   event ROW<block_hashes ARRAY<VARBINARY(8) NOT NULL>, block_size INT, medium STRING,
                             ownership STRING, reason STRING> NOT NULL> NOT NULL> NOT NULL,
  record_time TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
  WATERMARK FOR record_time AS record_time - INTERVAL '10' SECOND
) WITH (
  'connector' = 'kafka',
  'topic-pattern' = '{packed_topic_regex}',
  'properties.bootstrap.servers' = '{bootstrap}',
  'properties.group.id' = '{group}',
  'scan.startup.mode' = 'earliest-offset',
  'scan.bounded.mode' = 'latest-offset',
  'format' = 'avro-confluent',
  'avro-confluent.url' = '{registry_url}',
  'avro-confluent.schema' = '{packed_reader_schema}'
);

-- One row per consolidated event, whichever layout carried it: blocks' columns.
CREATE TEMPORARY VIEW block_events AS
SELECT replica, dp_rank, epoch, seq, `index`, ts, event, model, record_time FROM blocks
UNION ALL
SELECT p.replica, p.dp_rank, p.epoch, p.seq, e.`index`, p.ts, e.event, p.model, p.record_time
FROM blocks_packed AS p CROSS JOIN UNNEST(p.events) AS e (`index`, event);

CREATE TABLE raw_batches (
  replica STRING NOT NULL,
  dp_rank INT NOT NULL,
  worker_rank INT NOT NULL,
  workers INT NOT NULL,
  engine STRING NOT NULL,
  model STRING,
  epoch BIGINT NOT NULL,
  seq BIGINT NOT NULL,
  ts DOUBLE NOT NULL,
  topic STRING NOT NULL,
  events ARRAY<ROW<block_hashes ARRAY<VARBINARY(8) NOT NULL>, block_size INT, medium STRING, ownership STRING,
                   reason STRING> NOT NULL> NOT NULL,
  first_index INT NOT NULL,
  record_time TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL,
  WATERMARK FOR record_time AS record_time - INTERVAL '10' SECOND
) WITH (
  'connector' = 'kafka',
  'topic' = '{raw_topic}',
  'properties.bootstrap.servers' = '{bootstrap}',
  'properties.group.id' = '{group}',
  'scan.startup.mode' = 'earliest-offset',
  'scan.bounded.mode' = 'latest-offset',
  'format' = 'avro-confluent',
  'avro-confluent.url' = '{registry_url}',
  'avro-confluent.schema' = '{raw_reader_schema}'
);

-- name: stores_per_minute
-- Per replica (all data-parallel ranks and tiers) and minute of record time: blocks stored and
-- removed on the block topics of both layouts (kvbus.blocks, kvbus.blocks-packed and their tier topics),
-- and the events that did it (an event of a packed record counts as one).
SELECT replica, window_start AS `minute`,
       SUM(CASE WHEN event.block_size IS NOT NULL THEN CARDINALITY(event.block_hashes) ELSE 0 END) AS stored_blocks,
       SUM(CASE WHEN event.block_size IS NULL AND event.block_hashes IS NOT NULL
                THEN CARDINALITY(event.block_hashes) ELSE 0 END) AS removed_blocks,
       SUM(CASE WHEN event.block_size IS NOT NULL THEN 1 ELSE 0 END) AS store_events,
       SUM(CASE WHEN event.block_size IS NULL AND event.block_hashes IS NOT NULL THEN 1 ELSE 0 END) AS remove_events,
       SUM(CASE WHEN event.block_hashes IS NULL AND event.reason IS NULL THEN 1 ELSE 0 END) AS clears
FROM TABLE(TUMBLE(TABLE block_events, DESCRIPTOR(record_time), INTERVAL '1' MINUTES))
GROUP BY replica, window_start, window_end;

-- name: raw_per_minute
-- Per replica, tensor-parallel worker and minute of record time on kvbus.raw: records (engine
-- batches or parts of split ones) and the events they carried, as each worker reported them.
SELECT replica, worker_rank, window_start AS `minute`, COUNT(*) AS records, SUM(CARDINALITY(events)) AS events
FROM TABLE(TUMBLE(TABLE raw_batches, DESCRIPTOR(record_time), INTERVAL '1' MINUTES))
GROUP BY replica, worker_rank, window_start, window_end;
