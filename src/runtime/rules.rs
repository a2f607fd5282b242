//! The debounce rules in force for a runtime (SEMANTICS §4, §7): one [`Engine`] shared by
//! every partition task, replaceable while settle runs (tenant overrides). A partition task
//! takes the new rules at the start of its next loop turn, between two store batches, so a
//! new rule applies to every upload applied after the task saw it, and a pending round keeps
//! its due time until its next upload (the engine times a round by the rule in force at each
//! of its uploads; `engine::Round::policy`).

use crate::engine::Engine;
use std::sync::Arc;
use tokio::sync::watch;

/// The rules in force, cheap to clone (clones share them).
#[derive(Clone, Debug)]
pub struct Rules {
    tx: Arc<watch::Sender<Engine>>,
}

impl Rules {
    /// Rules starting with `engine`.
    pub fn new(engine: Engine) -> Self {
        Rules {
            tx: Arc::new(watch::Sender::new(engine)),
        }
    }

    /// The engine in force now (a clone: the policy table is copied).
    pub fn current(&self) -> Engine {
        self.tx.borrow().clone()
    }

    /// Puts `engine` in force: every partition task takes it at its next loop turn.
    pub fn set(&self, engine: Engine) {
        self.tx.send_replace(engine);
    }

    /// A receiver that sees each change (`has_changed`), for a partition task.
    pub fn subscribe(&self) -> watch::Receiver<Engine> {
        self.tx.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{PolicySpec, PolicyTable};

    #[test]
    fn a_subscriber_sees_the_rules_set_after_it_subscribed() {
        let rules = Rules::new(Engine::new(PolicyTable::uniform(PolicySpec::fixed(1_000))));
        let mut rx = rules.subscribe();
        assert!(!rx.has_changed().unwrap());
        rules.set(Engine::new(PolicyTable::uniform(PolicySpec::fixed(2_000))));
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().policies().default.delay, 2_000);
        assert_eq!(rules.current().policies().default.delay, 2_000);
    }
}
