//! One health schema for every role (router, shard, ranker): the JSON body of `/ready` and of
//! the router's `/v2/health/ready` (docs/protocol.md, "Health"). A role that serves everything
//! is `ready`; one that serves everything with some part down (one ranker of several) is
//! `degraded`, still HTTP 200; one that cannot serve some requests is `not_ready`, HTTP 503.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ready,
    Degraded,
    NotReady,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Health {
    /// "router", "shard" or "ranker".
    pub role: String,
    pub status: Status,
    /// `status` is ready or degraded: the role serves every request it may get.
    pub ready: bool,
    /// Parts that are down while the role still serves (a ranker of several).
    pub degraded: Vec<String>,
    /// Why the role cannot serve (empty when ready or degraded).
    pub problems: Vec<String>,
}

impl Health {
    /// The status follows from the lists: any problem means not ready.
    pub fn new(role: &str, degraded: Vec<String>, problems: Vec<String>) -> Health {
        let status = if !problems.is_empty() {
            Status::NotReady
        } else if !degraded.is_empty() {
            Status::Degraded
        } else {
            Status::Ready
        };
        Health {
            role: role.to_owned(),
            status,
            ready: status != Status::NotReady,
            degraded,
            problems,
        }
    }

    /// 200 while the role can serve, 503 otherwise.
    pub fn http_status(&self) -> u16 {
        if self.ready {
            200
        } else {
            503
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain strings and enums always serialize")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_follows_the_lists() {
        let h = Health::new("router", vec![], vec![]);
        assert_eq!((h.status, h.http_status()), (Status::Ready, 200));
        let h = Health::new("router", vec!["ranker a: down".into()], vec![]);
        assert_eq!((h.status, h.http_status()), (Status::Degraded, 200));
        let h = Health::new("router", vec!["ranker a".into()], vec!["shard b".into()]);
        assert_eq!((h.status, h.http_status()), (Status::NotReady, 503));
        assert_eq!(
            h.to_json(),
            r#"{"role":"router","status":"not_ready","ready":false,"degraded":["ranker a"],"problems":["shard b"]}"#
        );
    }
}
