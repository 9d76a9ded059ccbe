//! The envelope every inference request goes through, whatever its door and codec: its
//! budget starts at its first byte (the REST head's, or the gRPC call's HEADERS frame); a
//! budget already spent by then is a deadline error; admission control may shed it before its
//! body is read (with a retry hint); then its codec parses it, the pipeline runs it, the
//! codec encodes the reply; CPU per codec, stage latency, errors and the trace id are
//! recorded the same way for all. Doors (front/) only gather the head and the message.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::admission::{RankerLoad, Shed, Stages};
use crate::app::App;
use crate::budget::Budget;
use crate::codec::Codec;
use crate::error::{ErrorKind, Failure, RequestError, Stage};
use crate::metrics::thread_cpu;
use crate::pipeline::router::{Inference, Router};
use crate::tensor::Tensor;

/// The optional header (REST) or metadata (gRPC) that gives a request's budget before its
/// body is read, so that admission control judges it by its own budget (docs/api.md,
/// "Admission control").
pub const BUDGET_HEADER: &str = "cleave-budget-ms";

/// The optional header (REST) or metadata (gRPC) whose value picks a request's version
/// stably during a canary (docs/api.md, "Versions and rollout").
pub const KEY_HEADER: &str = "cleave-request-key";

/// What a door knows of a request before its body.
pub struct Head {
    pub model: String,
    /// The version the request names; none: its model's rollout chooses.
    pub version: Option<String>,
    /// The request key (`cleave-request-key`) a canary's choice hashes.
    pub key: Option<String>,
    /// When its first byte arrived.
    pub arrival: Instant,
    /// The budget its head asks for (`cleave-budget-ms`), or what is wrong with its head.
    pub asked: Result<Option<f64>, RequestError>,
    /// The door read the message before the envelope saw the request (gRPC: tonic hands the
    /// handler a whole message); else it reads it once the request is admitted (REST).
    pub message_read: bool,
}

/// Runs one request: `receive` gets the message once the request is admitted, reading until
/// the instant it is given (with the budget in ms that instant stands for, for the message).
pub async fn handle<C, R, F>(app: &App, codec: &C, head: Head, receive: R) -> C::Response
where
    C: Codec,
    R: FnOnce((Instant, f64)) -> F,
    F: Future<Output = Result<C::Message, RequestError>>,
{
    let metrics = &app.metrics;
    metrics.request();
    let arrival = head.arrival;
    let mut budget = Budget::new(arrival, app.default_budget_ms);
    let mut admitted = false;
    let mut chosen = None;
    let result = run(
        app,
        codec,
        &head,
        receive,
        &mut budget,
        &mut admitted,
        &mut chosen,
    )
    .await;
    let served = chosen.as_ref().map(|r: &Arc<Router>| &r.served);
    let trace_id = cleave_wire::log::trace_id(budget.trace_id);
    let (model, protocol) = (head.model.as_str(), codec.protocol().as_str());
    let mut response = match result {
        Ok(reply) => {
            metrics.observe(Stage::Total, arrival.elapsed());
            if let Some(served) = served {
                served.answered(arrival.elapsed());
            }
            tracing::debug!(%trace_id, model, protocol, elapsed_us = arrival.elapsed().as_micros() as u64, "answered");
            reply
        }
        Err(failure) => {
            let e = &failure.error;
            metrics.error(e.kind);
            if let Some(served) = served {
                served.error(e.kind);
            }
            if admitted && e.kind == ErrorKind::Deadline {
                metrics.expired_after_admission();
            }
            if failure.retry_after_s.is_some() {
                // Sheds are summarised once a second (shed_log.rs): a line each would flood.
                tracing::debug!(%trace_id, model, protocol, reason = %e.message, "request shed");
            } else {
                tracing::warn!(%trace_id, model, protocol, kind = ?e.kind, stage = ?e.stage, error = %e.message, "request failed");
            }
            codec.error(&failure)
        }
    };
    codec.finish(&mut response, &trace_id);
    response
}

async fn run<C, R, F>(
    app: &App,
    codec: &C,
    head: &Head,
    receive: R,
    budget: &mut Budget,
    admitted: &mut bool,
    chosen: &mut Option<Arc<Router>>,
) -> Result<C::Response, Failure>
where
    C: Codec,
    R: FnOnce((Instant, f64)) -> F,
    F: Future<Output = Result<C::Message, RequestError>>,
{
    // Held until the reply is encoded: an unload of this version waits for it.
    let router =
        app.repo
            .registry
            .choose(&head.model, head.version.as_deref(), head.key.as_deref())?;
    router.served.request();
    let router = &*chosen.insert(router);
    let model = &router.model;
    let asked = head.asked.clone()?;
    app.set_budget(budget, asked)?;
    // A message read before admission that took its whole budget to arrive is late, as a
    // REST body that does is (read_body), before admission judges it.
    if head.message_read {
        budget.check(Stage::Parse)?;
    }
    let load = RankerLoad::of(&router.rankers);
    let mut permit = app
        .admission
        .admit(budget.start.elapsed(), budget.budget, &load)
        .await
        .map_err(shed)?;
    *admitted = true;
    app.metrics.admitted();

    // The body's own budget_ms is not known until it is read: reading is bounded by the
    // head's budget, else by the largest budget a body may ask for (and by the rate).
    let read_ms = asked.unwrap_or(app.max_budget_ms);
    let until = budget.start + Duration::from_secs_f64(read_ms / 1e3);
    let message = receive((until, read_ms)).await?;

    let metrics = &app.metrics;
    let cpu = thread_cpu();
    let parsed = codec.parse(model, message);
    metrics.codec_cpu_plus("parse", codec.protocol(), cpu, codec.decode_cpu());
    let parsed = parsed?;
    check_body_version(head.version.as_deref(), parsed.version.as_deref())?;
    app.set_budget(budget, parsed.budget_ms)?;
    // The request's own size, charged before any lookup (the adaptive rule).
    let rows = rows(model, &parsed.inputs);
    app.admission
        .fit(&mut permit, rows, budget.left())
        .map_err(shed)?;
    let parsed_at = budget.start.elapsed();
    let inf = match router.infer(parsed.inputs, budget).await {
        Ok(inf) => inf,
        Err(e) => {
            if e.kind == ErrorKind::Deadline {
                app.admission.expired(&permit, budget.budget);
            }
            return Err(e.into());
        }
    };
    app.admission
        .observe(&permit, stages(parsed_at, &inf), budget.budget);
    if let Some(first) = inf.outputs.first().and_then(|t| t.to_f32()) {
        router.served.scores(&first);
    }
    let cpu = thread_cpu();
    let (reply, protocol) = codec.encode(model, parsed.context, inf);
    metrics.codec_cpu_plus("encode", protocol, cpu, codec.encode_cpu());
    Ok(reply)
}

/// A body's own `model_version` must be the URL's, when both name one.
fn check_body_version(url: Option<&str>, body: Option<&str>) -> Result<(), RequestError> {
    match (url, body) {
        (Some(url), Some(body)) if url != body => Err(RequestError::invalid(format!(
            "the body's model_version is {body:?} but the URL names version {url:?}"
        ))),
        _ => Ok(()),
    }
}

fn shed(shed: Shed) -> Failure {
    Failure {
        error: RequestError::new(ErrorKind::Overloaded, shed.message).at(Stage::Admission),
        retry_after_s: Some(shed.retry_after_s),
    }
}

/// A request's candidates: the batch dimension of its inputs (1 when it has none).
fn rows(model: &crate::model::Model, inputs: &[Option<Tensor>]) -> u64 {
    model
        .inputs
        .iter()
        .zip(inputs)
        .filter(|(spec, _)| spec.is_batch_major())
        .filter_map(|(_, t)| t.as_ref()?.dims.first().copied())
        .max()
        .unwrap_or(1) as u64
}

fn stages(parse: Duration, inf: &Inference) -> Stages {
    Stages {
        parse,
        lookup: inf.lookup,
        transfer: inf.transfer,
        batch: inf.compute,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_may_name_only_the_urls_version() {
        assert!(check_body_version(None, Some("7")).is_ok());
        assert!(check_body_version(Some("2"), None).is_ok());
        assert!(check_body_version(Some("2"), Some("2")).is_ok());
        let e = check_body_version(Some("2"), Some("1")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidInput);
        assert!(
            e.message
                .contains("model_version is \"1\" but the URL names version \"2\""),
            "{}",
            e.message
        );
    }
}
