//! Whether a receive's response reached its client. A delivery is recorded as held by its gRPC client before
//! the response carrying it is written ("write the new state, then act"); until the client has taken that
//! response in, it may never have seen the message, so an auto-renewed delivery must not be kept for it.
//!
//! The signal is the response body reaching its trailers. hyper asks the body for its next frame only after
//! the previous one fitted in the client's HTTP/2 flow-control window, so when the trailers are asked for,
//! every message of the response has been accepted by the client's window and handed to the socket. A client
//! that stops reading, or a stream that breaks first, never gets there: its receive sees the watch dropped.
//! (Nothing in gRPC tells more: Apache's proxy counts a message as sent once its `onNext` returned.)

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tonic::codegen::{http, Service};
use tonic::server::NamedService;

/// The receive's end of the watch, in the request's extensions: resolves when the response reached its
/// trailers, fails when the response was dropped before.
#[derive(Clone)]
pub(super) struct TakenIn(Arc<Mutex<Option<oneshot::Receiver<()>>>>);

impl TakenIn {
    /// The watch of this call's response (once: the receive takes it).
    pub(super) fn of(extensions: &http::Extensions) -> Option<oneshot::Receiver<()>> {
        extensions.get::<TakenIn>().and_then(|watch| watch.0.lock().take())
    }
}

/// Wraps the gRPC service: every `ReceiveMessage` call gets a [`TakenIn`] watch on its response body (and every
/// answer to a message over the decoding limit gRPC's usual code, see
/// [`super::status::oversize_as_resource_exhausted`]).
#[derive(Clone)]
pub(super) struct WatchReceives<S> {
    inner: S,
}

impl<S> WatchReceives<S> {
    pub(super) fn new(inner: S) -> WatchReceives<S> {
        WatchReceives { inner }
    }
}

impl<S: NamedService> NamedService for WatchReceives<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, RequestBody, ResponseBody> Service<http::Request<RequestBody>> for WatchReceives<S>
where
    S: Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Watched<ResponseBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<RequestBody>) -> Self::Future {
        let on_trailers = request.uri().path().ends_with("/ReceiveMessage").then(|| {
            let (taken_in, watch) = oneshot::channel();
            request.extensions_mut().insert(TakenIn(Arc::new(Mutex::new(Some(watch)))));
            taken_in
        });
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            super::status::oversize_as_resource_exhausted(response.headers_mut());
            Ok(response.map(|body| Watched { body, on_trailers }))
        })
    }
}

/// A response body that says when it reached its trailers (or its end).
pub(super) struct Watched<B> {
    body: B,
    on_trailers: Option<oneshot::Sender<()>>,
}

impl<B: Body + Unpin> Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        let ended = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(frame))) => frame.is_trailers(),
            Poll::Ready(Some(Err(_))) | Poll::Pending => false,
        };
        if ended {
            if let Some(taken_in) = self.on_trailers.take() {
                let _ = taken_in.send(());
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
