//! Reading one session's state from the partition task that owns it, for the admin endpoint
//! `GET /v1/sessions/{tenant}/{session}`.
//!
//! A partition task owns its store (STYLE §2), so nobody else reads it: each task registers
//! a query channel here while it runs and answers queries between its polls (a query is
//! answered while the task waits for input, never in the middle of a store batch). Which
//! partition holds a key depends on the producer's partitioner (Kafka clients differ), so a
//! lookup asks every partition this process owns and takes the one that has the key.

use crate::engine::{Millis, PolicyName, SessionKey, SessionState};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Queries a partition task may have waiting before further ones are refused as busy.
const QUEUE: usize = 16;

/// A session's state as its partition task read it from its store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionView {
    /// Input topic of the partition.
    pub topic: String,
    /// Partition whose store holds the key.
    pub partition: i32,
    /// The key's stored state: generation, CallTrack, open round (SEMANTICS §4).
    pub state: SessionState,
    /// The key's one timer (ms): the open round's due time, or the state's expiry
    /// (`last upload + state-ttl`) when no round is open.
    pub next_due: Millis,
    /// Policy in force for the tenant.
    pub policy: PolicyName,
}

/// What a partition task answers: the key's state, `None` when its store has none.
pub type Answer = Result<Option<SessionView>, String>;

/// What a partition task answers between its polls.
#[derive(Debug)]
pub enum Query {
    /// One session's state.
    Session(SessionQuery),
    /// A slice of its pending rounds ([`super::pending`]).
    Pending(super::pending::SliceQuery),
}

/// One question about a session to a partition task.
#[derive(Debug)]
pub struct SessionQuery {
    /// The session key asked for.
    pub key: SessionKey,
    /// Where the answer goes (a dropped receiver is ignored).
    pub reply: oneshot::Sender<Answer>,
}

/// Outcome of [`SessionLookup::find`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// A partition of this process holds the key.
    Found(Box<SessionView>),
    /// Every partition owned here answered and none holds the key (or none is owned):
    /// the session is not owned here, or has no state.
    NotFound {
        /// Partitions asked.
        asked: usize,
    },
    /// No partition holds the key, but some could not answer (store error, busy, stopping,
    /// or no answer within the timeout): the key may be there.
    Unavailable {
        /// What went wrong, per partition.
        errors: Vec<(i32, String)>,
    },
}

/// The query channels of the partition tasks of one runtime. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct SessionLookup {
    tasks: Arc<Mutex<BTreeMap<i32, mpsc::Sender<Query>>>>,
}

/// Keeps a partition task's query channel registered; removes it when dropped.
#[derive(Debug)]
pub struct Registration {
    lookup: SessionLookup,
    partition: i32,
    tx: mpsc::Sender<Query>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut tasks = self.lookup.lock();
        // A newer task of the same partition may have registered since: leave it.
        if tasks
            .get(&self.partition)
            .is_some_and(|tx| tx.same_channel(&self.tx))
        {
            tasks.remove(&self.partition);
        }
    }
}

impl SessionLookup {
    /// No partition registered.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<i32, mpsc::Sender<Query>>> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers the task of `partition`; it answers what arrives on the receiver until the
    /// registration is dropped.
    pub fn register(&self, partition: i32) -> (Registration, mpsc::Receiver<Query>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        self.lock().insert(partition, tx.clone());
        let registration = Registration {
            lookup: self.clone(),
            partition,
            tx,
        };
        (registration, rx)
    }

    /// The registered tasks' query channels, by partition (sorted).
    pub(crate) fn senders(&self) -> Vec<(i32, mpsc::Sender<Query>)> {
        self.lock().iter().map(|(p, tx)| (*p, tx.clone())).collect()
    }

    /// Partitions with a registered task, sorted.
    pub fn partitions(&self) -> Vec<i32> {
        self.lock().keys().copied().collect()
    }

    /// Asks every registered partition task for `key`, waiting at most `timeout` for the
    /// answers.
    pub async fn find(&self, key: &SessionKey, timeout: Duration) -> Lookup {
        let tasks = self.senders();
        let asked = tasks.len();
        let mut errors = Vec::new();
        let mut waiting = Vec::new();
        for (partition, tx) in tasks {
            let (reply, rx) = oneshot::channel();
            let query = SessionQuery {
                key: key.clone(),
                reply,
            };
            match tx.try_send(Query::Session(query)) {
                Ok(()) => waiting.push((partition, rx)),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    errors.push((partition, "busy: too many queries waiting".to_owned()));
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    errors.push((partition, "the partition task has stopped".to_owned()));
                }
            }
        }
        let answers = futures::future::join_all(waiting.into_iter().map(|(p, rx)| async move {
            match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(answer)) => (p, answer),
                Ok(Err(_)) => (p, Err("the partition task has stopped".to_owned())),
                Err(_) => (p, Err(format!("no answer within {timeout:?}"))),
            }
        }))
        .await;
        for (p, answer) in answers {
            match answer {
                Ok(Some(view)) => return Lookup::Found(Box::new(view)),
                Ok(None) => {}
                Err(e) => errors.push((p, e)),
            }
        }
        if errors.is_empty() {
            Lookup::NotFound { asked }
        } else {
            errors.sort();
            Lookup::Unavailable { errors }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn asks_every_partition_and_unregisters_on_drop() {
        let lookup = SessionLookup::new();
        let key = SessionKey::new("t", "s");
        assert_eq!(
            lookup.find(&key, Duration::from_secs(1)).await,
            Lookup::NotFound { asked: 0 }
        );
        let (r0, mut q0) = lookup.register(0);
        let (r1, mut q1) = lookup.register(1);
        let view = SessionView {
            topic: "uploads".into(),
            partition: 1,
            state: SessionState::default(),
            next_due: 5,
            policy: PolicyName::Fixed,
        };
        let answering = {
            let view = view.clone();
            tokio::spawn(async move {
                let Some(Query::Session(q)) = q0.recv().await else {
                    panic!("a session query")
                };
                let _ = q.reply.send(Ok(None));
                let Some(Query::Session(q)) = q1.recv().await else {
                    panic!("a session query")
                };
                assert_eq!(q.key.as_str(), "t/s");
                let _ = q.reply.send(Ok(Some(view)));
                (q0, q1)
            })
        };
        assert_eq!(
            lookup.find(&key, Duration::from_secs(5)).await,
            Lookup::Found(Box::new(view))
        );
        let (q0, q1) = answering.await.unwrap();
        drop(q1);
        let Lookup::Unavailable { errors } = lookup.find(&key, Duration::from_secs(1)).await else {
            panic!("partition 1 cannot answer");
        };
        assert_eq!(errors.len(), 2, "0 does not answer in time, 1 is closed");
        drop((r0, r1, q0));
        assert!(lookup.partitions().is_empty());
    }
}
