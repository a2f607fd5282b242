//! The end-to-end integration tests: settle on real brokers (Kafka through
//! `SETTLE_TEST_KAFKA`, NATS JetStream through `SETTLE_TEST_NATS`, rdkafka's `MockCluster`)
//! and as real `settle` child processes (`CARGO_BIN_EXE_settle`: SIGKILL, SIGTERM,
//! rebalances, exactly-once).
//!
//! One test binary (one link of RocksDB and librdkafka) with a module per former
//! `tests/*.rs` file. The tests run as threads of one process: every test names its own
//! topics, streams, consumer groups and data directories (the test's name, the process id
//! and the time), takes any free port, and sets environment variables only on the child
//! processes it spawns, never on this process. A broker test fails when its variable is set
//! and the broker is absent (or under `CI`), and says loudly that it did not run otherwise.
//!
//! `SETTLE_TEST_KAFKA=127.0.0.1:9092 SETTLE_TEST_NATS=127.0.0.1:4222 cargo test --test e2e`
//! runs them; `cargo test --test e2e -- kafka_process::` one former file.

#[path = "../support/admin.rs"]
mod admin_support;
#[path = "../support/kafka.rs"]
mod kafka_support;
#[path = "../support/nats.rs"]
mod nats_support;
#[path = "../support/process.rs"]
mod process_support;
#[path = "../support/proxy.rs"]
mod proxy_support;
#[path = "../support/running.rs"]
mod running_support;
#[path = "../support/runtime.rs"]
mod runtime_support;

mod admin_cli;
mod admin_kafka;
mod broker_smoke;
mod cli_output;
mod crash_kill;
mod hostile_input;
mod kafka_actions;
mod kafka_eos;
mod kafka_outage;
mod kafka_overrides;
mod kafka_pipeline;
mod kafka_process;
mod kafka_rebalance;
mod kafka_tiers;
mod kafka_transport;
mod nats_actions;
mod nats_deployments;
mod nats_overrides;
mod nats_pipeline;
mod nats_process;
mod nats_rescale;
mod nats_tier_counts;
mod nats_tiers;
mod nats_whatif;
mod shadow_run_file;
mod signals;
mod tune_kafka;
mod tune_nats;
mod ui_browser;
