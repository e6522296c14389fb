package org.torchrecserve.plugin;

import java.util.Map;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import org.pytorch.serve.http.RequestTimeoutException;
import org.pytorch.serve.http.ServiceUnavailableException;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.util.messages.RequestInput;
import org.pytorch.serve.util.messages.WorkerCommands;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.ModelManager;

/**
 * A describe call to whichever worker of a model takes it first, answered into a future: the
 * worker's description (our handler answers with its pid, artifact, load time, ...).
 *
 * <p>Also the way to wake a worker that waits idle for work: it takes the describe, answers, and
 * comes back to its loop, where it sees that it was asked to stop (see {@link Drain}).
 */
final class DescribeJob extends Job {
    final CompletableFuture<byte[]> answer = new CompletableFuture<>();

    DescribeJob(String modelName, String version) {
        this(modelName, version, null);
    }

    /** With {@code freshness}: one of the handler's freshness calls (JSON), answered in JSON. */
    DescribeJob(String modelName, String version, String freshness) {
        super(modelName, version, WorkerCommands.DESCRIBE, describeInput(freshness));
    }

    private static RequestInput describeInput(String freshness) {
        RequestInput input = new RequestInput(UUID.randomUUID().toString());
        input.updateHeaders("describe", "True"); // as TorchServe's own ?customized=true does
        if (freshness != null) {
            input.updateHeaders("freshness", freshness);
        }
        return input;
    }

    /** Queues the call for a worker of {@code model} and waits for its answer. */
    byte[] call(Model model) throws Exception {
        if (!ModelManager.getInstance().addJob(this)) {
            throw new ServiceUnavailableException(Guard.label(model) + " has no worker to take the call");
        }
        try {
            return answer.get(model.getResponseTimeout(), TimeUnit.SECONDS);
        } catch (TimeoutException e) {
            throw new RequestTimeoutException("no worker of " + Guard.label(model) + " answered");
        } catch (ExecutionException e) {
            throw new ServiceUnavailableException(e.getCause().getMessage());
        }
    }

    @Override
    public void response(
            byte[] body,
            CharSequence contentType,
            int statusCode,
            String statusPhrase,
            Map<String, String> responseHeaders) {
        if (statusCode == 200) {
            answer.complete(body);
        } else {
            answer.completeExceptionally(
                    new IllegalStateException("the worker answered the describe call with " + statusCode));
        }
    }

    @Override
    public void sendError(int status, String error) {
        answer.completeExceptionally(new IllegalStateException(error));
    }

    @Override
    public boolean isOpen() {
        return true;
    }
}
